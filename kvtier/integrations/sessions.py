"""Many parked conversations within a host-memory budget; when it fills, the coldest go on to disk."""

from __future__ import annotations

from collections import OrderedDict

from ..errors import ConfigError
from .hf import TieredCache


class SessionStore:
    """Parks caches by name, host memory first, least recently parked pushed to disk beyond `host_bytes`.

    Parameters
    ----------
    host_bytes
        Host memory the parked sessions may use together (their parked device entries and host pages).
    """

    def __init__(self, host_bytes: int) -> None:
        if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < 0:
            raise ConfigError(f"host_bytes={host_bytes!r}; allowed: a whole number of bytes >= 0")
        self.host_bytes = host_bytes
        self._parked: OrderedDict[str, TieredCache] = OrderedDict()

    def park(self, name: str, cache: TieredCache) -> None:
        """Park `cache` under `name` in host memory, then push the coldest sessions to disk as needed."""
        cache.park("host")
        self._parked[name] = cache
        self._parked.move_to_end(name)
        for other, parked in list(self._parked.items()):
            if self.host_bytes_used() <= self.host_bytes:
                break
            if parked.parked == "host":
                parked.park("disk")

    def resume(self, name: str) -> TieredCache:
        """Take a session back; its layers return to the device at their next use."""
        if name not in self._parked:
            raise KeyError(f"no parked session {name!r}; parked: {', '.join(self._parked) or 'none'}")
        return self._parked.pop(name)

    def host_bytes_used(self) -> int:
        return sum(c.stats()["host"]["bytes"] for c in self._parked.values() if c.parked == "host")

    def where(self) -> dict[str, str | None]:
        """Each parked session and where it is."""
        return {name: cache.parked for name, cache in self._parked.items()}

    def close(self) -> None:
        for cache in self._parked.values():
            cache.close()
        self._parked.clear()
