"""Scoring: rank cache entries from key, value and position (see `base` for the contract)."""

from .base import Scorer, checked_scores
from .registry import (BASELINES_ATTENTION_BASED, BASELINES_ATTENTION_FREE, available_scorers, make_scorer,
                       register_scorer)

__all__ = ["BASELINES_ATTENTION_BASED", "BASELINES_ATTENTION_FREE", "Scorer", "available_scorers", "checked_scores", "make_scorer", "register_scorer"]
