"""Scorers by name: built-ins are imported lazily; plugins come in through the `kvtier.scorers` entry point.

Whatever `make_scorer` returns is a `Scorer` or a `QueryScorer` (see `base`); a bad ``needs_query`` marker is
refused here, when the scorer is made, rather than at the first step.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from ..errors import ConfigError
from .base import QueryScorer, Scorer, needs_query, scorer_name

# the built-in baselines, by what they need: attention-free ones rank from key, value and position alone
BASELINES_ATTENTION_FREE = ("recency", "keynorm", "keydiff", "random")
BASELINES_ATTENTION_BASED = ("tova", "snapkv", "h2o")

_BUILTIN = {
    "recency": ("kvtier.scoring.recency", "RecencyScorer"),
    "keynorm": ("kvtier.scoring.keynorm", "KeyNormScorer"),
    "random": ("kvtier.scoring.random", "RandomScorer"),
    "keydiff": ("kvtier.scoring.keydiff", "KeyDiffScorer"),
    "kvp": ("kvtier.scoring.kvp", "KVPScorer"),
    "tova": ("kvtier.scoring.tova", "TOVAScorer"),
    "snapkv": ("kvtier.scoring.snapkv", "SnapKVScorer"),
    "h2o": ("kvtier.scoring.h2o", "H2OScorer"),
}


def register_scorer(name: str, module_path: str, class_name: str) -> None:
    """Make `name` resolve to ``module_path.class_name``, imported on first use."""
    _BUILTIN[name] = (module_path, class_name)


def available_scorers() -> list[str]:
    """Names `make_scorer` accepts."""
    plugins = {ep.name for ep in entry_points(group="kvtier.scorers")}
    return sorted(set(_BUILTIN) | plugins)


def make_scorer(spec: str | Scorer | QueryScorer, **kwargs: Any) -> Scorer | QueryScorer:
    """Build a scorer from a name (with keyword settings) or return a scorer object unchanged."""
    if not isinstance(spec, str):
        if isinstance(spec, type):   # its score() would miss an argument at the first step
            raise ConfigError(f"scorer={spec.__name__} is a class; allowed: an instance of it ({spec.__name__}()), "
                              f"or a name: {', '.join(available_scorers())}")
        if kwargs:   # they would be dropped without a word
            raise ConfigError(f"settings {', '.join(sorted(kwargs))} given with a scorer object "
                              f"({scorer_name(spec)}); allowed: settings with a scorer's name, or none")
        if not callable(getattr(spec, "score", None)):
            raise ConfigError(f"scorer={spec!r} is neither a scorer name nor an object with a score() method; "
                              f"allowed names: {', '.join(available_scorers())}")
        needs_query(spec)   # a bad marker fails now, not at the first step
        return spec
    if spec in _BUILTIN:
        module_path, class_name = _BUILTIN[spec]
        cls = getattr(importlib.import_module(module_path), class_name)
    else:
        found = [ep for ep in entry_points(group="kvtier.scorers") if ep.name == spec]
        if not found:
            raise ConfigError(f"scorer={spec!r} is unknown; allowed: {', '.join(available_scorers())}")
        cls = found[0].load()
    scorer = cls(**kwargs)
    needs_query(scorer)
    return scorer
