"""`TieredCache`: a transformers ``Cache`` whose layers keep KV in GPU, host and disk tiers.

Works with transformers 5.5 and later (``get_mask_sizes(query_length)``; both ``past_key_values=`` and,
from 5.24, ``cache=``). Each layer reports the logical length from ``get_seq_length()`` and, from
``get_mask_sizes()``, the number of entries ``update`` returns with the offset of the rest, the way
transformers' sliding-window layer does.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers.cache_utils import Cache, CacheLayerMixin

from ..config import ModelShape, TieredCacheConfig
from ..engine.layer import LayerEngine
from ..engine.parking import check_target
from ..engine.resources import SharedResources, make_private_dir
from ..errors import ConfigError, UnsupportedError
from ..placement.budget import Budget
from ..scoring import Scorer, make_scorer
from .attention import claim, restore_attention, use_tiered_attention


class TieredLayer(CacheLayerMixin):
    """One model layer of a `TieredCache`; forwards to its `LayerEngine`."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, engine: LayerEngine) -> None:
        super().__init__()
        self.engine = engine

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.engine.write(key_states, value_states)
        self.is_initialized = True
        claim(keys, self.engine)
        return keys, values

    def get_seq_length(self, *args: Any) -> int:
        return self.engine.seen

    def get_mask_sizes(self, query_length: int | torch.Tensor, *args: Any) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older API passed cache_position
            query_length = query_length.shape[0]
        self.engine.flush()
        stored = self.engine.stored
        return stored + int(query_length), self.engine.seen - stored

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length

    def reset(self) -> None:
        self.engine.reset()

    def offload(self) -> None:  # the tiers do their own moving
        return None

    def prefetch(self) -> None:
        return None

    def crop(self, tokens_to_remove: int) -> None:
        raise UnsupportedError(f"crop({tokens_to_remove}) is not supported by TieredCache (assisted or "
                               "speculative decoding); use greedy or sampling generation")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if beam_idx.numel() != 1 or int(beam_idx.reshape(-1)[0]) != 0:
            raise UnsupportedError("beam search is not supported by TieredCache (batch size 1 only)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise UnsupportedError(f"batch_repeat_interleave({repeats}): TieredCache supports batch size 1 only")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if indices.numel() != 1 or int(indices.reshape(-1)[0]) != 0:
            raise UnsupportedError("batch_select_indices: TieredCache supports batch size 1 only")


def _close(engines: list[LayerEngine], shared: SharedResources) -> None:
    for engine in engines:
        engine.close()
    shared.close()


class TieredCache(Cache):
    """A drop-in transformers cache that keeps the best-ranked KV entries on the device.

    Parameters
    ----------
    config
        The model's config (``model.config``). The model's attention is routed through kvtier's
        function, which gives the cache the query for recall and is transparent to other caches.
    device_budget
        Tokens per KV head on the device: fraction (0, 1] of the tokens seen, or a token count.
    host_budget
        Tokens per KV head in host memory (fraction or count); lower-ranked pages go to disk. ``None``:
        no limit (nothing goes to disk).
    disk_dir
        Folder for disk pages (a private subfolder is made and removed on close); ``None``: a temporary folder.
    scorer
        A scorer name (``"kvp"``, ``"keynorm"``, ``"keydiff"``, ``"recency"``, ``"random"``) or an object
        with ``score()``. ``None``: the shipped KVP scorer when one was trained for this model, else
        ``"keynorm"``.
    mode
        ``"tier"`` (demote and recall) or ``"evict"`` (drop; the KVP paper's setting).
    recall_pages
        Demoted pages brought back per layer and KV head at each step.
    page_size, sink_tokens, recent_tokens
        See `TieredCacheConfig`.
    scorer_kwargs
        Settings for a scorer given by name (e.g. ``{"seed": 1}`` for ``"random"``).
    """

    def __init__(self, config: Any, device_budget: float | int = 0.25, host_budget: float | int | None = None,
                 disk_dir: str | os.PathLike | None = None, scorer: str | Scorer | None = None,
                 mode: str = "tier", recall_pages: int = 64, *, page_size: int = 16, sink_tokens: int = 4,
                 recent_tokens: int = 16, scorer_kwargs: dict[str, Any] | None = None) -> None:
        shape = ModelShape.from_config(config)
        scorer_kwargs = dict(scorer_kwargs or {})
        if scorer is None:
            from ..scoring.kvp import shipped_for

            model = shipped_for(config)
            scorer = "kvp" if model else "keynorm"
            if model:
                scorer_kwargs.setdefault("model", model)
        self.settings = TieredCacheConfig(
            shape=shape,
            device_budget=Budget(device_budget, "device_budget"),
            host_budget=None if host_budget is None else Budget(host_budget, "host_budget", allow_zero=True),
            disk_dir=None if disk_dir is None else os.fspath(disk_dir),
            mode=mode, recall_pages=recall_pages, page_size=page_size, sink_tokens=sink_tokens,
            recent_tokens=recent_tokens,
            scorer_name=scorer if isinstance(scorer, str) else getattr(scorer, "name", type(scorer).__name__),
        )
        self.scorer = make_scorer(scorer, **scorer_kwargs)
        if hasattr(self.scorer, "check_model"):
            self.scorer.check_model(shape.num_layers, shape.num_kv_heads, shape.head_dim)
        self._shared = SharedResources(self.settings.disk_dir)
        if self.settings.mode == "tier" and self.settings.host_budget is not None:
            self._shared.private_dir()   # a bad disk_dir fails here, not in the middle of a step
        self.counters = self._shared.counters
        engines = [LayerEngine(i, self.settings, self.scorer, self._shared) for i in range(shape.num_layers)]
        super().__init__(layers=[TieredLayer(e) for e in engines])
        self._engines = engines
        # the finalizer holds the engines and the shared resources, never the cache: a dropped cache is collected
        self._finalizer = weakref.finalize(self, _close, engines, self._shared)
        self.model_config = config
        use_tiered_attention(config)

    def park(self, to: str = "host") -> None:
        """Move the whole cache off the device between turns: ``"host"`` memory or ``"disk"``.

        The next forward restores each layer just before it is used (so restoring overlaps that forward,
        layer by layer), and generation continues exactly as if the cache had never moved.
        """
        check_target(to)
        for engine in self._engines:
            engine.park(to)

    def resume(self) -> None:
        """Restore every parked layer now (otherwise each comes back at its next use)."""
        for engine in self._engines:
            engine.restore()

    @property
    def parked(self) -> str | None:
        """Where the cache is parked (``"host"``, ``"disk"``), or None when it is live."""
        places = {e.parked.where for e in self._engines if e.parked is not None}
        return max(places, key=("host", "disk").index) if places else None

    @property
    def disk_path(self) -> str | None:
        """The private folder holding this cache's disk pages (None without a disk tier)."""
        return self._shared.private_path

    def stats(self) -> dict[str, Any]:
        """What the cache holds and what it moved.

        ``device``/``host``/``disk``: ``tokens`` (entries summed over layers and KV heads, measured
        from the pools), ``bytes`` held (host bytes include the 2-bit key codes of the recall index and the
        disk pages kept for read-ahead), ``reserved_bytes`` allocated; ``device.index_bytes``: the key bounds
        of the demoted pages, 1/16 of their K+V size at 16 entries a page. ``read_ahead``: disk pages served
        from host memory (``hits``) or read on demand (``misses``), and the ``hit_rate``.
        ``bytes_moved`` per direction,
        ``pages_recalled`` per source tier (pages moved up), ``pages_reused`` (chosen pages the device already
        held from the step before), ``transfer_wait_seconds`` (blocked on copies and disk reads).
        """
        tiers: dict[str, dict[str, int]] = {t: {"tokens": 0, "bytes": 0, "reserved_bytes": 0}
                                             for t in ("device", "host", "disk")}
        tiers["device"]["index_bytes"] = 0
        for engine in self._engines:
            for tier, numbers in engine.usage().items():
                for key, value in numbers.items():
                    tiers[tier][key] += value
        if self._shared.disk_store is not None:
            tiers["disk"]["reserved_bytes"] = self._shared.disk_store.file_bytes()
        c = self.counters
        wait = c.disk_wait_seconds + sum(t.counters.wait_seconds for t in self._shared.transfers.values())
        ahead = [e.readahead for e in self._engines if e.readahead is not None]
        hits, misses = sum(r.hits for r in ahead), sum(r.misses for r in ahead)
        seen = self._engines[0].seen if self._engines else 0
        s = self.settings
        return {
            **tiers,
            "tokens_seen": seen,
            "layers": s.shape.num_layers,
            "kv_heads": s.shape.num_kv_heads,
            "budget_tokens_per_head": {"device": s.device_tokens(seen), "host": s.host_tokens(seen)},
            "bytes_moved": dict(c.bytes_moved),
            "pages_recalled": c.pages_recalled["host"] + c.pages_recalled["disk"],
            "pages_recalled_from": dict(c.pages_recalled),
            "recall_steps": c.recall_steps,
            "pages_reused": c.pages_reused,
            "tokens_dropped": c.tokens_dropped,
            "transfer_wait_seconds": wait,
            "read_ahead": {"hits": hits, "misses": misses, "pages_read_ahead": sum(r.read_ahead for r in ahead),
                           "hit_rate": hits / (hits + misses) if hits + misses else None,
                           "pages_held": sum(r.pages() for r in ahead)},
            "parked": self.parked,
            "mode": s.mode,
            "scorer": s.scorer_name,
        }

    def close(self) -> None:
        """Release pools, close and delete disk files (also done at exit and when collected)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def detach_attention(self) -> None:
        """Give the model back its own attention implementation."""
        restore_attention(self.model_config)


def cache_kwargs(cache: Cache) -> dict[str, Cache]:
    """The keyword this transformers version expects for a cache: ``cache=`` from 5.24, else ``past_key_values=``.

    ``model.generate(ids, **cache_kwargs(cache))`` runs without deprecation warnings on both.
    """
    return {"cache": cache} if _CACHE_KEYWORD else {"past_key_values": cache}


_CACHE_KEYWORD = Version(transformers.__version__).release >= (5, 24)
