"""Policies under evaluation: the full cache, eviction with a scorer, tiering with recall."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

FULL_RECALL = 1_000_000
RECALL_PAGES = 64   # the library default: 1,024 tokens per layer and KV head per step


@dataclass(frozen=True)
class Policy:
    """``full``, ``evict:<scorer>``, ``tier:<scorer>`` (recall `RECALL_PAGES` pages) or ``tier-all:<scorer>`` (every page)."""

    kind: str
    scorer: str | None = None

    @classmethod
    def parse(cls, text: str) -> Policy:
        kind, _, scorer = text.partition(":")
        if kind == "full" and not scorer:
            return cls("full")
        if kind in ("evict", "tier", "tier-all") and scorer:
            return cls(kind, scorer)
        raise ConfigError(f"policy {text!r}; allowed: full, evict:<scorer>, tier:<scorer>, tier-all:<scorer>")

    @property
    def name(self) -> str:
        return self.kind if self.scorer is None else f"{self.kind}:{self.scorer}"

    def cache_settings(self, budget: float) -> dict[str, Any]:
        if self.kind == "evict":
            return dict(device_budget=budget, mode="evict", scorer=self.scorer)
        return dict(device_budget=budget, host_budget=None, mode="tier", scorer=self.scorer,
                    recall_pages=FULL_RECALL if self.kind == "tier-all" else RECALL_PAGES)
