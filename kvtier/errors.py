"""The exception hierarchy: every error kvtier raises on purpose derives from `KVTierError`."""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of kvtier's errors."""


class ConfigError(KVTierError, ValueError):
    """A setting is out of range or of the wrong type; the message names the value and what is allowed."""


class ScorerError(KVTierError, ValueError):
    """A scorer returned something the placement cannot rank (wrong shape, dtype or NaN)."""


class CapacityError(KVTierError):
    """A tier could not take what it was asked to hold (disk full, pinning refused, ...)."""


class CorruptPageError(KVTierError):
    """A page read back from disk does not match its checksum, or is missing."""


class TransferError(KVTierError):
    """A copy between tiers failed."""


class NativeUnavailableError(KVTierError):
    """A CUDA-only path was asked for on a machine without CUDA or cupy."""


class UnsupportedError(KVTierError, NotImplementedError):
    """The caller asked for something kvtier does not support yet (batch > 1, cropping, ...)."""


class ModelNotInstalledError(KVTierError, FileNotFoundError):
    """The default model's package is not installed; the message says how to install it."""
