"""Transfer: moving bytes between tiers (CUDA streams where there is CUDA, synchronous otherwise)."""

from __future__ import annotations

import torch

from .base import TransferCounters, TransferManager
from .sync import SyncTransferManager


def make_transfer_manager(device: torch.device) -> TransferManager:
    """The CUDA-stream manager for a CUDA device, the synchronous one otherwise."""
    if torch.device(device).type == "cuda":
        from .cuda_streams import CudaTransferManager

        return CudaTransferManager(device)
    return SyncTransferManager()


__all__ = ["SyncTransferManager", "TransferCounters", "TransferManager", "make_transfer_manager"]
