"""The cache's settings, validated once, in one frozen dataclass."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .placement.budget import Budget

MODES = ("tier", "evict")
# defaults, defined once: the cache's keywords, its settings and the tools that train and grade scorers use them
DEFAULT_RECALL_PAGES = 64
DEFAULT_PAGE_SIZE = 16
DEFAULT_SINK_TOKENS = 4
DEFAULT_RECENT_TOKENS = 16


def _whole(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ConfigError(f"{name}={value!r} is not allowed; allowed: a whole number >= {low}")
    return int(value)


def _count(config: str, name: str, value: Any) -> int:
    """A positive whole number read from a model config, else a `ConfigError` naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"the model config {config} has {name}={value!r}; allowed: a whole number >= 1")
    return int(value)


@dataclass(frozen=True)
class ModelShape:
    """What the cache needs to know of the model: layers, KV heads and head size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """Read the shape from a transformers config (the text config of a multimodal model)."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        name = type(config).__name__
        try:
            layers = config.num_hidden_layers
            q_heads = config.num_attention_heads
        except AttributeError as e:
            raise ConfigError(f"the model config {name} has no {e.name!r}; "
                              "kvtier needs num_hidden_layers and num_attention_heads") from e
        layers = _count(name, "num_hidden_layers", layers)
        q_heads = _count(name, "num_attention_heads", q_heads)
        kv_heads = getattr(config, "num_key_value_heads", None)
        kv_heads = q_heads if kv_heads is None else _count(name, "num_key_value_heads", kv_heads)
        if q_heads % kv_heads:
            raise ConfigError(f"the model config {name} has num_attention_heads={q_heads}, not a multiple of "
                              f"num_key_value_heads={kv_heads}; allowed: query heads in whole groups per KV head")
        head_dim = getattr(config, "head_dim", None)
        if head_dim is None:
            hidden = _count(name, "hidden_size", getattr(config, "hidden_size", None))
            if hidden % q_heads:
                raise ConfigError(f"the model config {name} has hidden_size={hidden}, not divisible by "
                                  f"num_attention_heads={q_heads}, and no head_dim; allowed: a hidden size that "
                                  "is a multiple of the heads, or an explicit head_dim")
            head_dim = hidden // q_heads
        head_dim = _count(name, "head_dim", head_dim)
        return cls(layers, kv_heads, int(head_dim))


@dataclass(frozen=True)
class TieredCacheConfig:
    """Settings of a `TieredCache`.

    Parameters
    ----------
    device_budget
        Tokens per KV head kept on the device (GPU, or a budgeted in-memory pool without CUDA): a
        fraction in (0, 1] of the tokens seen, or a token count. Sinks and the recent window count inside it.
    host_budget
        Tokens per KV head in host memory (pinned on CUDA machines); the lowest-ranked pages below it
        go to disk. ``None`` lets the host hold everything demoted. Only for ``mode="tier"``.
    disk_dir
        Where disk pages go; a private folder is made inside it and removed on close. ``None``: a
        temporary folder.
    mode
        ``"tier"`` demotes low-ranked entries and recalls them at decode; ``"evict"`` drops them.
    recall_pages
        Pages recalled per layer and KV head at each step (0 disables recall).
    page_size
        Tokens per page in the host and disk tiers.
    sink_tokens, recent_tokens
        The first and the latest tokens, always kept on the device.
    """

    shape: ModelShape
    device_budget: Budget
    host_budget: Budget | None = None
    disk_dir: str | None = None
    mode: str = "tier"
    recall_pages: int = DEFAULT_RECALL_PAGES
    page_size: int = DEFAULT_PAGE_SIZE
    sink_tokens: int = DEFAULT_SINK_TOKENS
    recent_tokens: int = DEFAULT_RECENT_TOKENS
    scorer_name: str = field(default="keynorm", compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} is not allowed; allowed: {', '.join(map(repr, MODES))}")
        _whole("recall_pages", self.recall_pages, 0)
        _whole("page_size", self.page_size, 1)
        _whole("sink_tokens", self.sink_tokens, 0)
        _whole("recent_tokens", self.recent_tokens, 0)
        protected = self.sink_tokens + self.recent_tokens
        if not self.device_budget.is_fraction and self.device_budget.value < max(protected, 1):
            raise ConfigError(
                f"device_budget={self.device_budget.value} tokens leaves no room for the {self.sink_tokens} "
                f"sink tokens and the {self.recent_tokens}-token recent window; allowed: a token count "
                f">= {max(protected, 1)}, or a fraction of the tokens seen")
        if self.mode == "evict" and (self.host_budget is not None or self.disk_dir is not None):
            raise ConfigError("mode='evict' drops demoted entries, so host_budget and disk_dir must be None; "
                              f"got host_budget={self.host_budget and self.host_budget.value!r}, "
                              f"disk_dir={self.disk_dir!r}")

    def device_tokens(self, seen: int) -> int:
        """The device budget in tokens after `seen` tokens; never below the sinks and recent window."""
        return max(self.device_budget.tokens(seen),
                   min(seen, self.sink_tokens + self.recent_tokens))

    def host_tokens(self, seen: int) -> int | None:
        """The host budget in tokens after `seen` tokens (None: unbounded)."""
        return None if self.host_budget is None else self.host_budget.tokens(seen)
