"""Policies under evaluation: the full cache, eviction with a scorer, tiering with recall."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

FULL_RECALL = 1_000_000
RECALL_PAGES = 64   # the library default: 1,024 tokens per layer and KV head per step


def _recent(text: str, whole: str) -> int | float:
    from ..config import check_recent_tokens

    try:
        value: int | float = int(text) if text.isdigit() else float(text)
    except ValueError:
        raise ConfigError(f"policy {whole!r}: recent window {text!r}; allowed: a whole number of tokens, or a "
                          "float in (0, 1) (a share of the device budget), e.g. evict:kvp@64 or evict:kvp@0.25"
                          ) from None
    return check_recent_tokens(value, f"the recent window of policy {whole!r}")


@dataclass(frozen=True)
class Policy:
    """``full``, ``evict:<scorer>``, ``tier:<scorer>`` (recall `RECALL_PAGES` pages) or ``tier-all:<scorer>``
    (every page).

    A scorer may carry a recent window after ``@``: ``evict:kvp@64`` keeps the 64 latest tokens,
    ``evict:kvp@0.25`` the latest quarter of the device budget (else the library default).
    """

    kind: str
    scorer: str | None = None
    recent: int | float | None = None

    @classmethod
    def parse(cls, text: str) -> Policy:
        kind, _, scorer = text.partition(":")
        if kind == "full" and not scorer:
            return cls("full")
        scorer, at, recent = scorer.partition("@")
        if kind in ("evict", "tier", "tier-all") and scorer and (recent or not at):
            return cls(kind, scorer, _recent(recent, text) if at else None)
        raise ConfigError(f"policy {text!r}; allowed: full, evict:<scorer>, tier:<scorer>, tier-all:<scorer>, "
                          "each with an optional recent window, e.g. evict:kvp@64 or evict:kvp@0.25")

    @property
    def name(self) -> str:
        if self.scorer is None:
            return self.kind
        # every digit kept: `:g` had named a window of 1,000,001 tokens as one of 1,000,000 (1e+06, unparsable)
        return f"{self.kind}:{self.scorer}" + ("" if self.recent is None else f"@{self.recent}")

    def cache_settings(self, budget: float) -> dict[str, Any]:
        extra = {} if self.recent is None else {"recent_tokens": self.recent}
        if self.kind == "evict":
            return dict(device_budget=budget, mode="evict", scorer=self.scorer, **extra)
        return dict(device_budget=budget, host_budget=None, mode="tier", scorer=self.scorer,
                    recall_pages=FULL_RECALL if self.kind == "tier-all" else RECALL_PAGES, **extra)
