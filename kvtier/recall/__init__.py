"""Recall: per-page key bounds and the query-aware choice of demoted pages to bring back."""

from .bounds import page_bounds, upper_bounds
from .selector import select_pages

__all__ = ["page_bounds", "select_pages", "upper_bounds"]
