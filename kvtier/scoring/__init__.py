"""Scoring: rank cache entries once, when written (`Scorer`) or after attention (`QueryScorer`); see `base`."""

from .base import (AgeAware, ModelBound, QueryScorer, Scorer, capturable, check_scorer_model, checked_scores,
                   nan_error, needs_query, ranking_scores, scorer_name, takes_softcap)
from .registry import (BASELINES_ATTENTION_BASED, BASELINES_ATTENTION_FREE, available_scorers, make_scorer,
                       register_scorer)

__all__ = ["AgeAware", "nan_error", "BASELINES_ATTENTION_BASED", "BASELINES_ATTENTION_FREE", "ModelBound",
           "QueryScorer", "Scorer", "available_scorers", "capturable", "check_scorer_model", "checked_scores",
           "make_scorer", "needs_query", "ranking_scores", "register_scorer", "scorer_name", "takes_softcap"]
