"""Synthetic long-context tasks generated offline from templates: `needle` owns the needle texts and haystacks."""

from .chat import chat_ids
from .needle import NeedleTask, make_needle_task

__all__ = ["NeedleTask", "chat_ids", "make_needle_task"]
