"""Placement: budgets and the plans that say which entries move between tiers (no data is touched here)."""

from .budget import Budget
from .planner import page_rank, plan_device_demotion, plan_host_overflow, plan_promotion, protected_count

__all__ = ["Budget", "page_rank", "plan_device_demotion", "plan_host_overflow", "plan_promotion",
           "protected_count"]
