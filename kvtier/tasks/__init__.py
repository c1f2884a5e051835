"""Synthetic long-context tasks generated offline from templates."""

from .needle import NeedleTask, make_needle_task

__all__ = ["NeedleTask", "make_needle_task"]
