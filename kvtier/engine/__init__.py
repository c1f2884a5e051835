"""Engine: per-layer orchestration of write, score, place and recall."""

from .layer import LayerEngine
from .stats import MoveCounters

__all__ = ["LayerEngine", "MoveCounters"]
