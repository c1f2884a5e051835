"""kvtier: a KV-cache memory hierarchy (GPU, pinned host memory, disk) ranked by learned scores.

The public interface: `TieredCache` (a drop-in transformers cache), `DecodeGraph` (a model's decode steps with
it, replayed as one CUDA graph each), `load_default_model` and `load_model`, the scorers (`make_scorer`) and the
errors.
"""

from .errors import (BrokenCacheError, CapacityError, ClosedCacheError, ConfigError, CorruptPageError, KVTierError,
                     ModelNotInstalledError, ScorerError, TransferError, UnsupportedError)
from .integrations.hf import TieredCache, cache_kwargs
from .integrations.model_graph import DecodeGraph
from .models import load_default_model, load_model
from .scoring import QueryScorer, Scorer, available_scorers, make_scorer

__version__ = "0.1.0"

__all__ = [
    "BrokenCacheError", "CapacityError", "DecodeGraph", "ClosedCacheError", "ConfigError", "CorruptPageError", "KVTierError", "ModelNotInstalledError", "QueryScorer", "Scorer",
    "ScorerError", "TieredCache", "TransferError", "cache_kwargs", "UnsupportedError", "available_scorers", "load_default_model",
    "load_model", "make_scorer", "__version__",
]
