"""The cache's settings, validated once, in one frozen dataclass."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError, check_whole
from .placement.budget import Budget
from .placement.planner import recent_window

MODES = ("tier", "evict")
# defaults, defined once: the cache's keywords, its settings and the tools that train and grade scorers use them
DEFAULT_RECALL_PAGES = 64
DEFAULT_PAGE_SIZE = 16
MAX_PAGE_SIZE = 1024   # a page is what recall moves: larger ones make it coarse and reserve memory by the page
DEFAULT_SINK_TOKENS = 4
# the recent window: a whole number of tokens, or a float in (0, 1): that share of the device budget.
# A quarter of the budget, from measurement (docs/scorer-objective.md): against a fixed 16 tokens it lowers
# KVP's evict-mode perplexity in 10 of 12 cells (2K/4K, 5-25%), keeps tier mode at 5% within 0.4% of the
# full cache up to 8K, keeps the held-out kept attention mass within 0.002 and ties every task cell measured
# at 2K; half the budget or more loses retrieval at 5%.
DEFAULT_RECENT_TOKENS = 0.25
# pages per KV head a decode step's demotion moves at least, in tier mode (see `TieredCacheConfig.demote_pages`)
DEFAULT_DEMOTE_PAGES = 4


def check_recent_tokens(value: Any, name: str = "recent_tokens") -> int | float:
    """A recent window setting: a whole number >= 0 (tokens) or a float in (0, 1) (a share of the device budget)."""
    allowed = "a whole number of tokens >= 0, or a float in (0, 1): that share of the device budget"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name}={value!r} is not allowed; allowed: {allowed}")
    if isinstance(value, numbers.Integral):
        if value < 0:
            raise ConfigError(f"{name}={value!r} is not allowed; allowed: {allowed}")
        return int(value)
    v = float(value)
    if math.isnan(v) or not 0.0 < v < 1.0:
        raise ConfigError(f"{name}={value!r} is not allowed; allowed: {allowed}")
    return v


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
    prefetch_pages
        Pages per layer and KV head brought up ahead of the next step, beyond `recall_pages`: the next-ranked
        pages of a step's choice, copied on a side stream while the other layers compute (where recall is
        planned on the device: CUDA, every demoted page of the layer in host memory). ``None``: half of
        `recall_pages` there, none elsewhere (without a side stream nothing can overlap). Attention reads
        only the chosen pages, so the setting changes what moves and when, never the output.
    retain_pages
        Pages per layer and KV head the recall buffer keeps after a step stops choosing them, beyond
        `recall_pages`, where recall is planned on the host on the CPU: the choice near its edge swings back and
        forth from step to step, and a page chosen again soon is then found in the buffer instead of read again
        from host memory or disk. 0 (the default): none. It pays where a read costs by the page (a disk that
        does not answer from the page cache: docs/benchmarks.md). Attention reads the chosen pages only (the
        others masked out), so the setting changes what moves, not which pages are read; its sums run in
        another order, so the output agrees with a buffer that keeps none within rounding, not bit for bit.
        A copy or a resumed cache takes the same pages into the same slots, so either goes on bit for bit.
    page_size
        Tokens per page in the host and disk tiers: 1 to `MAX_PAGE_SIZE` (1,024). A page is what recall brings
        up and what the pools reserve memory by, so a larger one makes recall coarse and reserves memory out of
        proportion to a short prompt.
    sink_tokens, recent_tokens
        The first and the latest tokens, always kept on the device. `recent_tokens` is a token count, or a
        float in (0, 1): that share of the device budget (the window grows with the budget).
    demote_pages
        Pages per KV head a demotion moves at least, where that many may move: a decoding layer then demotes
        once every that many pages of steps instead of every page, so what a demotion costs the host (its
        planning and copies, and a CUDA graph's capture after it, as the layer's page count changed) is shared
        by that many more steps; the device tier sits up to that many pages under its budget after one.
        ``None``: in tier mode, `DEFAULT_DEMOTE_PAGES` (the pages come back by recall), at most an eighth of
        the device budget; in evict mode 1 (what leaves is lost).
    cuda_graphs
        Replay a decode step's attention and recall from a CUDA graph per layer, captured again when the layer's
        state changes (`kvtier.engine.graphs`), where recall is planned on the device and the native kernels
        run; elsewhere (a CPU, no cupy, disk pages), and where a capture fails, the same launches run eagerly.
        The output is the same bits either way. On by default: a step's launches cost the host more than the
        GPU's work behind them, and on an H200 the replayed 128K step of the Llama-3.1-8B shape took half the
        eager one's time (docs/benchmarks.md). ``False`` issues every launch eagerly.
    read_ahead
        Read short-listed disk pages ahead of need into a ring of host memory (`kvtier.tiers.readahead`; half
        the recall budget per layer and KV head, at most a quarter of the host budget, taken from it). ``None``:
        the ring judges every few steps whether its hits saved more than its reads cost, and pauses where they
        did not (a disk that answers from the operating system's page cache). ``True``: always read ahead (a
        slow disk on a machine whose CPU is free). ``False``: no ring; the host tier keeps its whole budget.
        Only disk pages are affected, and never the output. A layer makes its ring when it first spills to
        disk, sized then (`read_ahead_pages`); where that size is 0 (fewer than 2 recall pages, a host budget
        under 4 pages), no page is read ahead whatever the setting.
    promote
        ``True``: keep disk pages that recall brings up in host memory, in place of the host pages least used
        lately (`kvtier.placement.planner.plan_promotion`); the disk keeps a clean copy, so such a page goes back
        down without a write. It reads a fifth to a quarter fewer disk pages, but on the machine measured
        (docs/benchmarks.md) a read's cost was its call's, not its pages', and the rounds cost as much as they
        saved, so it is off by default: for a disk whose reads cost by the page. ``False`` (the default): the
        host tier holds the highest-ranked pages, whatever recall asks for. Only where the pages are, and so
        the disk reads, are affected, never the output.
    """

    shape: ModelShape
    device_budget: Budget
    host_budget: Budget | None = None
    disk_dir: str | None = None
    mode: str = "tier"
    recall_pages: int = DEFAULT_RECALL_PAGES
    prefetch_pages: int | None = None
    retain_pages: int = 0
    page_size: int = DEFAULT_PAGE_SIZE
    sink_tokens: int = DEFAULT_SINK_TOKENS
    recent_tokens: int | float = DEFAULT_RECENT_TOKENS
    demote_pages: int | None = None
    cuda_graphs: bool = field(default=True, compare=False)   # how steps run, not what they hold
    read_ahead: bool | None = None
    promote: bool = False
    scorer_name: str = field(default="keynorm", compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} is not allowed; allowed: {', '.join(map(repr, MODES))}")
        check_whole("recall_pages", self.recall_pages, 0)
        if self.prefetch_pages is not None:
            check_whole("prefetch_pages", self.prefetch_pages, 0)
        check_whole("retain_pages", self.retain_pages, 0)
        check_whole("page_size", self.page_size, 1)
        if self.page_size > MAX_PAGE_SIZE:
            raise ConfigError(f"page_size={self.page_size!r} is not allowed; allowed: a whole number from 1 to "
                              f"{MAX_PAGE_SIZE}")
        check_whole("sink_tokens", self.sink_tokens, 0)
        if self.demote_pages is not None:
            check_whole("demote_pages", self.demote_pages, 1)
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"cuda_graphs={self.cuda_graphs!r}; allowed: True or False")
        if self.read_ahead is not None and not isinstance(self.read_ahead, bool):
            raise ConfigError(f"read_ahead={self.read_ahead!r}; allowed: None (judged as it goes), True or False")
        if not isinstance(self.promote, bool):
            raise ConfigError(f"promote={self.promote!r}; allowed: True or False")
        object.__setattr__(self, "recent_tokens", check_recent_tokens(self.recent_tokens))
        if not self.device_budget.is_fraction:
            budget = self.device_budget.value
            window = recent_window(self.recent_tokens, budget)
            protected = self.sink_tokens + window
            if budget < max(protected, 1):
                least = max(protected, 1)
                while least < self.sink_tokens + recent_window(self.recent_tokens, least):
                    least += 1
                shown = (f"{window}-token recent window" if not isinstance(self.recent_tokens, float)
                         else f"{window}-token recent window ({self.recent_tokens:g} of the budget)")
                raise ConfigError(
                    f"device_budget={budget} tokens leaves no room for the {self.sink_tokens} "
                    f"sink tokens and the {shown}; allowed: a token count "
                    f">= {least}, or a fraction of the tokens seen")
        if self.mode == "evict" and (self.host_budget is not None or self.disk_dir is not None):
            raise ConfigError("mode='evict' drops demoted entries, so host_budget and disk_dir must be None; "
                              f"got host_budget={self.host_budget and self.host_budget.value!r}, "
                              f"disk_dir={self.disk_dir!r}")

    def device_tokens(self, seen: int) -> int:
        """The device budget in tokens after `seen` tokens; never below the sinks and the recent window worked out
        from the budget returned (a window that is a share of the budget grows with it: a budget raised only to
        the window of the smaller budget would hold less than the planner then keeps)."""
        budget = self.device_budget.tokens(seen)
        sinks, recent = self.sink_tokens, self.recent_tokens
        if budget >= min(seen, sinks + recent_window(recent, budget)):
            return budget
        if not isinstance(recent, float):
            return min(seen, sinks + int(recent))
        # the least b >= budget with b - ceil(recent * b) >= sinks (that difference never falls as b grows);
        # it is at least sinks / (1 - recent), so the search starts just below that
        b = max(budget, int(sinks / (1 - recent)) - 2)
        while b < seen and b < sinks + recent_window(recent, b):
            b += 1
        return min(b, seen)

    def demotion_pages(self, budget_tokens: int) -> int:
        """Pages per KV head a demotion moves at least, for a device budget of `budget_tokens` (`demote_pages`)."""
        if self.demote_pages is not None:
            return self.demote_pages
        if self.mode == "evict":
            return 1
        return max(1, min(DEFAULT_DEMOTE_PAGES, budget_tokens // (8 * self.page_size)))

    def prefetch(self, on_device: bool) -> int:
        """Pages per KV head prefetched for the next step by a layer whose recall is planned `on_device`."""
        if not on_device or not self.recall_pages:
            return 0
        return self.recall_pages // 2 if self.prefetch_pages is None else self.prefetch_pages

    def retain(self, on_device: bool) -> int:
        """Pages per KV head a recall buffer keeps after a step stops choosing them (`retain_pages`), where recall
        is planned on the host; none where it is planned `on_device` (its spare slots take the prefetch)."""
        return 0 if on_device or not self.recall_pages else self.retain_pages

    def recent_window(self, seen: int) -> int:
        """The recent window in tokens after `seen` tokens (a share of the device budget, or fixed)."""
        return min(seen, recent_window(self.recent_tokens, self.device_tokens(seen)))

    def read_ahead_pages(self, seen: int) -> int:
        """Disk pages per KV head of the read-ahead ring a layer makes when it first uses the disk after `seen`
        tokens (its size from then on, taken from the host budget): half the recall budget, at most a quarter
        of the host budget; none without a host budget, in evict mode, or with `read_ahead` off."""
        host = self.host_tokens(max(seen, 1))
        if host is None or self.read_ahead is False or self.mode != "tier":
            return 0
        return min(self.recall_pages // 2, host // (4 * self.page_size))

    def host_tokens(self, seen: int) -> int | None:
        """The host budget in tokens after `seen` tokens (None: unbounded)."""
        return None if self.host_budget is None else self.host_budget.tokens(seen)
