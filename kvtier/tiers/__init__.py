"""Tiers: the device pool, the host page pool and the disk page store."""

from .device import DevicePool
from .disk import DiskStore
from .host import HostPool

__all__ = ["DevicePool", "DiskStore", "HostPool"]
