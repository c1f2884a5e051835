"""`TieredCache`: a transformers ``Cache`` whose layers keep KV in GPU, host and disk tiers.

Works with the transformers releases `requirement` allows (``get_mask_sizes(query_length)``; both
``past_key_values=`` and, from 5.24, ``cache=``). Each layer reports the logical length from
``get_seq_length()`` and, from ``get_mask_sizes()``, the number of entries ``update`` returns with the offset
of the rest, the way transformers' sliding-window layer does.
"""

from __future__ import annotations

import copy
import inspect
import os
import warnings
import weakref
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers.cache_utils import Cache

from ..config import (DEFAULT_PAGE_SIZE, DEFAULT_RECALL_PAGES, DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS,
                      ModelShape, TieredCacheConfig)
from ..engine.copy import clone_counters, copy_layer
from ..engine.layer import LayerEngine
from ..engine.parking import check_target, parked_path
from ..engine.resources import SharedResources
from ..errors import CapacityError, ConfigError, UnsupportedError, call_each, is_resource_error, os_reason
from ..placement.budget import Budget
from ..scoring import QueryScorer, Scorer, check_scorer_model, make_scorer, scorer_name
from ..tiers.pinned import empty_pinned_cache
from .attention import restore_attention, use_tiered_attention
from .layers import NO_CACHE, TIERED, WINDOWED, LayerPlan, WindowLayer, layer_plan
from .tiered_layer import CacheState, GuardedWindow, OneSequence, TieredLayer, plain_tensors


def _close(state: CacheState) -> None:
    state.closed = True
    if os.getpid() != state.pid:   # a forked child: the pools and files are its parent's
        return
    try:
        call_each((state.drop_reads,   # before the files they read go
                   *(engine.close for engine in state.engines), *(window.reset for window in state.windows),
                   state.shared.close))
    finally:
        if any(getattr(e, "pin", False) for e in state.engines):   # the pinned slabs let go: to the system too
            empty_pinned_cache()


class TieredCache(OneSequence, Cache):
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
        no limit (nothing goes to disk). Pages a full or failing disk refuses stay on the host, up to twice the
        budget, until a later demotion moves them down (``stats()["spills_deferred"]``); past that the disk's
        error stands.
    disk_dir
        Folder for disk pages (a private subfolder is made and removed on close); ``None``: a temporary folder.
    scorer
        A scorer name (``"kvp"``, ``"keynorm"``, ``"keydiff"``, ``"recency"``, ``"random"``, or the
        attention-based ``"tova"``, ``"snapkv"``, ``"h2o"``: `kvtier.scoring.available_scorers`) or an object
        with ``score()``. ``None``: the shipped KVP scorer when one was trained for this model, else
        ``"keynorm"``.
    mode
        ``"tier"`` (demote and recall) or ``"evict"`` (drop; the KVP paper's setting).
    recall_pages
        Demoted pages brought back per layer and KV head at each step.
    prefetch_pages
        Pages per layer and KV head brought up ahead of the next step on a side stream (CUDA); ``None``: half
        of `recall_pages` on CUDA, none elsewhere. See `TieredCacheConfig`; it never changes the output.
    retain_pages
        Pages per layer and KV head the recall buffer keeps after a step stops choosing them, where recall is
        planned on the host on the CPU: chosen again soon, such a page is not read again. 0 (the default):
        none; for a disk whose reads cost by the page. See `TieredCacheConfig`.
    page_size, sink_tokens, recent_tokens
        See `TieredCacheConfig`; `recent_tokens` is a token count or, as by default (0.25), a share of the
        device budget.
    demote_pages
        Pages per KV head a demotion moves at least (see `TieredCacheConfig`); ``None``: 4 in tier mode (at
        most an eighth of the device budget), 1 in evict mode.
    scorer_kwargs
        Settings for a scorer given by name (e.g. ``{"seed": 1}`` for ``"random"``).
    cuda_graphs
        Replay decode steps' attention and recall from CUDA graphs where the cache runs on CUDA (see
        `TieredCacheConfig`; on by default, ``False`` issues every launch eagerly).
    read_ahead
        Read short-listed disk pages ahead of need into host memory: ``None`` (the default) judges as it goes
        whether that pays and pauses where it does not, ``True`` always, ``False`` never (the host tier then
        keeps its whole budget). See `TieredCacheConfig`; it never changes the output.
    promote
        Keep disk pages that recall keeps bringing up in host memory, in place of host pages used less lately
        (``True``), or leave the host tier holding the highest-ranked pages (``False``, the default: on the
        machine measured it read fewer disk pages but did not decode faster). See `TieredCacheConfig`; it never
        changes the output.
    """

    def __init__(self, config: Any, device_budget: float | int = 0.25, host_budget: float | int | None = None,
                 disk_dir: str | os.PathLike | None = None, scorer: str | Scorer | QueryScorer | None = None,
                 mode: str = "tier", recall_pages: int = DEFAULT_RECALL_PAGES, *,
                 prefetch_pages: int | None = None, retain_pages: int = 0,
                 page_size: int = DEFAULT_PAGE_SIZE, sink_tokens: int = DEFAULT_SINK_TOKENS,
                 recent_tokens: int | float = DEFAULT_RECENT_TOKENS, scorer_kwargs: dict[str, Any] | None = None,
                 demote_pages: int | None = None, cuda_graphs: bool = True, read_ahead: bool | None = None,
                 promote: bool = False) -> None:
        _check_config(config)
        plan = layer_plan(config)
        shape = ModelShape.from_config(config)
        if scorer_kwargs is not None and not isinstance(scorer_kwargs, dict):
            raise ConfigError(f"scorer_kwargs={scorer_kwargs!r}; allowed: a dict of settings for a scorer given "
                              "by name, or None")
        if scorer_kwargs and scorer is not None and not isinstance(scorer, str):
            raise ConfigError(f"scorer_kwargs={scorer_kwargs!r} is given with a scorer object, which takes no "
                              "settings; allowed: scorer_kwargs only with a scorer given by name")
        scorer_kwargs = dict(scorer_kwargs or {})
        if scorer is None:
            from ..scoring.kvp import shipped_for

            model = shipped_for(config, shape.head_dim)
            scorer = "kvp" if model else "keynorm"
            if model:
                scorer_kwargs.setdefault("model", model)
        self.settings = TieredCacheConfig(
            shape=shape,
            device_budget=Budget(device_budget, "device_budget"),
            host_budget=None if host_budget is None else Budget(host_budget, "host_budget", allow_zero=True),
            disk_dir=_folder(disk_dir),
            mode=mode, recall_pages=recall_pages, prefetch_pages=prefetch_pages, retain_pages=retain_pages,
            page_size=page_size, sink_tokens=sink_tokens,
            recent_tokens=recent_tokens, demote_pages=demote_pages, cuda_graphs=cuda_graphs, read_ahead=read_ahead,
            promote=promote,
            scorer_name=scorer if isinstance(scorer, str) else scorer_name(scorer),
        )
        if isinstance(scorer, str):
            _check_scorer_kwargs(scorer, scorer_kwargs)
        self.scorer = make_scorer(scorer, **scorer_kwargs)
        check_scorer_model(self.scorer, shape.num_layers, shape.num_kv_heads, shape.head_dim, config)
        self._shared = SharedResources(self.settings.disk_dir)
        self.counters = self._shared.counters
        self.plan: LayerPlan = plan
        self._state = CacheState([], [], self._shared)
        layers = self._make_layers(plan)
        self._engines = self._state.engines
        # the finalizer holds the engines and the shared resources, never the cache: a dropped cache is
        # collected (and closed); registered before anything is made, so a failure below leaves nothing behind
        self._finalizer = weakref.finalize(self, _close, self._state)
        try:
            if self.settings.mode == "tier" and self.settings.host_budget is not None:
                self._shared.private_dir(validate=True)   # a bad disk_dir fails here, not in the middle of a step
            super().__init__(layers=layers)
            self.model_config = config
            use_tiered_attention(config)
            self._state.config = config
        except BaseException:
            self._finalizer()
            raise
        if not self._engines:
            warnings.warn(f"every cache layer of {type(config).__name__} is a sliding-window layer (window "
                          f"{plan.settings[0].get('sliding_window') if plan.settings else None}): a TieredCache "
                          "keeps them as transformers does and has nothing to tier", stacklevel=2)

    def _make_layers(self, plan: LayerPlan) -> list:
        """One cache layer per model layer: tiered full-attention layers, transformers' window layers, and
        transformers' own placeholder for layers that store nothing."""
        from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

        st, layers = self._state, []
        for i, (kind, settings) in enumerate(zip(plan.kinds, plan.settings)):
            if kind == TIERED:
                engine = LayerEngine(i, self.settings, self.scorer, self._shared)
                st.engines.append(engine)
                layers.append(TieredLayer(engine, st))
            elif kind in WINDOWED:
                window = GuardedWindow(settings["sliding_window"], i, st)
                st.windows.append(window)
                layers.append(window)
            else:
                assert kind in NO_CACHE
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind]())
        stores = [i for i, kind in enumerate(plan.kinds) if kind not in NO_CACHE]
        st.first = stores[0] if stores else 0
        return layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' update, with a layer the cache was not made for refused by name: a model of more layers
        than its config's had met a bare IndexError after the first layers had taken the step."""
        if not 0 <= layer_idx < len(self.layers):
            text = (f"layer {layer_idx} of the model: this TieredCache was made for a config of {len(self.layers)} "
                    f"layers ({type(self.model_config).__name__}); allowed: a model of that config")
            if any(self._state.lengths()):   # the layers before it took the step: they would disagree with it
                self._state.break_with(text)
            raise UnsupportedError(text)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def park(self, to: str = "host") -> None:
        """Move the whole cache off the device between turns: ``"host"`` memory or ``"disk"``.

        The next forward restores every layer before any takes its step (a restore that fails then leaves the
        cache usable), and generation continues exactly as if the cache had never moved.

        Sliding-window layers go there too: to host memory, or each to a checksummed file of its window.

        All or nothing: when a layer cannot be parked (disk full, file-size limit, too many open files,
        read-only folder, ...), the layers this call already parked are put back as they were and a
        `CapacityError` naming the cause is raised; the cache then generates exactly as if never asked.
        """
        st = self._state
        st.check()
        check_target(to)
        st.drop_reads()   # reads made ahead (`prefetch_parked`) stop before the layers move
        with plain_tensors():   # what the parked layers keep is written again after they come back
            self._park(to)
        if any(e.pin for e in self._engines):   # the host pool's and the ring's slabs let go: to the system too
            empty_pinned_cache()

    def _park(self, to: str) -> None:
        """Every layer prepares its park (`LayerEngine.prepare_park`, `WindowLayer.park`), keeping what it held;
        then all settle, or, where one failed, all drop what they wrote, reading nothing back."""
        st = self._state
        # the windows that move (those on disk stay there)
        moved = [w for w in st.windows if w.is_initialized and w.where not in (to, "disk")]
        prepared: list[LayerEngine] = []
        try:
            for window in moved:
                path = None
                if to == "disk":
                    path = parked_path(self._shared.private_dir(), "window", window.layer_idx)
                window.park(to, path)
        except BaseException as e:
            for window in moved:
                window.undo_park()
            if not (isinstance(e, CapacityError) or is_resource_error(e)):
                raise
            where = "host memory" if to == "host" else "disk"
            raise CapacityError(f"park({to!r}) could not move the sliding-window layers to {where}: {os_reason(e)}; "
                                "every layer is as it was before the call") from e
        try:
            for engine in self._engines:
                prepared.append(engine)
                engine.prepare_park(to)
        except BaseException as e:
            for done in reversed(prepared):
                done.undo_park()
            for window in moved:
                window.undo_park()
            if not (isinstance(e, CapacityError) or is_resource_error(e)):
                raise
            engine, reason = prepared[-1], os_reason(e)
            detail = "" if reason == str(e) else f" [{e}]"
            raise CapacityError(f"park({to!r}) failed at layer {engine.layer_idx} (tiered layer {len(prepared)} of "
                                f"{len(self._engines)}): {reason}{detail}; every layer is as it was before the "
                                "call") from e
        try:   # bookkeeping only; an interruption (Ctrl-C) here leaves layers half let go: the cache says so
            for engine in self._engines:
                engine.settle_park()
            for window in moved:
                window.settle_park()
        except BaseException as e:
            st.break_with(e, f"park({to!r}) was interrupted while its layers let go and ")
            raise

    def prefetch_parked(self) -> bool:
        """Start reading the layers parked on disk back into host memory on a thread of their own, and return at
        once: for an application that knows the conversation is coming back (its user is typing, its request
        waits behind others), so that the restore at the next step (or `resume()`) waits for less.

        The restore takes what was read, checked as every disk read is, and is otherwise unchanged: the same
        state, bit for bit, and a read that failed is made again by the restore, which raises what it would have
        raised. Until the restore, the reads hold about the layers' parked bytes in host memory, and the new slabs
        of a layer parked on the host whole host-pool slabs, what its restore would take
        (``stats()["resume_prefetch"]["held_bytes"]``); `park()`, `reset()` and `close()` stop them and let them
        go. Layers parked on the host need no read, but those that let their host pool's slabs go (a pool mostly
        empty, `park`) have their host pages put into new slabs the same way, which the restore then takes whole
        (on a GPU, pinned memory: allocating it is off the step's path too). Returns whether the thread started
        (False: nothing to do ahead, reads are under way, or no thread could be started: the restore then does it
        all as it would have).
        """
        st = self._state
        st.check()
        return st.start_reads()

    def resume(self) -> None:
        """Restore every parked layer now (otherwise they come back together at the next step, before any layer
        takes it); after `prefetch_parked()`, waiting for its reads first."""
        self._state.check()
        with plain_tensors():   # what comes back is written by later steps, which may run outside inference mode
            self._state.restore_all()

    def reset(self) -> None:
        """Forget every entry (the cache stays open); also makes a broken cache usable again."""
        self._state.check_process()
        if self._state.closed:
            self._state.check()
        self._state.drop_reads()
        super().reset()
        self._state.broken = None

    def take_gpu_path(self, plan_on_device: bool = True) -> TieredCache:
        """Make every tiered layer take the decode path a CUDA device takes, whatever the device
        (`LayerEngine.take_gpu_path`): how a machine without a GPU checks and counts the GPU's work. The
        kernels' sums round in another order than the CPU's matrix products, so outputs may differ from the
        CPU path's in the last bits. A scorer object given to several caches switches for all of them (KVP's
        one-launch scoring is the scorer's own setting). Returns the cache."""
        self._state.check()
        if not isinstance(plan_on_device, bool):   # "False" had planned on the device, None as a CUDA device would
            raise ConfigError(f"plan_on_device={plan_on_device!r}; allowed: True or False")
        for engine in self._engines:
            engine.take_gpu_path(plan_on_device)
        return self

    @property
    def broken(self) -> str | None:
        """Why the cache is broken (a step failed midway), or None; `reset()` clears it."""
        return self._state.broken

    @property
    def parked(self) -> str | None:
        """Where the cache is parked (``"host"``, ``"disk"``), or None when it is live."""
        places = {e.parked.where for e in self._engines if e.parked is not None}
        places |= {w.where for w in self._state.windows if w.parked}
        return max(places, key=("host", "disk").index) if places else None

    @property
    def disk_path(self) -> str | None:
        """The private folder holding this cache's disk pages (None without a disk tier)."""
        return self._shared.private_path

    def stats(self) -> dict[str, Any]:
        """What the cache holds and what it moved.

        ``device``/``host``/``disk``: ``tokens`` (entries summed over layers and KV heads, measured
        from the pools), ``bytes`` held (host bytes include the 2-bit key codes of the recall index and the
        disk pages kept for read-ahead; disk bytes the clean copies of host pages brought up from disk),
        ``reserved_bytes`` allocated; ``device.index_bytes``: the key bounds of the demoted pages, 1/16 of their
        K+V size at 16 entries a page; ``device.recall_bytes``: the recall buffers (the pages brought up for
        attention, with their slot tables). ``promotion``: disk pages recall brought up that the host tier kept
        (``pages``), and host pages moved down to their clean copy without a write
        (``moved_down_unwritten``), and rounds stopped by a full disk or no memory (``rounds_skipped``; each
        move is all or nothing, the output the same); zero with ``promote=False``. ``read_ahead``: disk pages served
        from host memory (``hits``) or read on demand (``misses``), the ``hit_rate``, and the layer steps that
        skipped reading ahead where it did not pay (``steps_paused``); all zero without a ring
        (``read_ahead=False``), every disk page then read on demand. ``spills_deferred``: moves of host pages
        to disk that the disk refused (full, failing; ``rounds``, and the ``last_error``): the pages stayed in
        host memory, over ``host_budget`` (up to twice it), the answers the same, and later demotions try again.
        Budgets and the tier figures count the tiered (full-attention) layers only; ``window`` gives the
        sliding-window layers, which keep transformers' own window on the device (``bytes`` in memory, wherever it
        is; ``disk_bytes`` of windows parked on disk).
        ``bytes_moved`` per direction,
        ``pages_recalled`` (pages moved up, prefetched ones included; ``pages_recalled_from`` per source tier),
        ``pages_reused`` (chosen
        pages already on the device when chosen: kept from an earlier step or prefetched) and ``reuse_rate``
        (their share of the chosen pages: the hit rate of "what is on the device is what will be chosen"; the
        rest were fetched on demand), ``prefetch`` (``pages`` brought up ahead of the next step on the side
        stream, ``used``: those a later step chose, ``hit_rate``: ``used / pages``),
        ``transfer_wait_seconds`` (blocked on copies and disk reads). ``resume_prefetch``: parked layers restored
        from reads made ahead by `prefetch_parked` (``layers``), the reads made ahead that failed (``failed``: the
        restore reads those layers itself), the seconds restores waited for reads still under way
        (``wait_seconds``), whether reads are under way (``in_flight``) and the host bytes the reads not yet taken
        hold (``held_bytes``).
        """
        tiers: dict[str, dict[str, int]] = {t: {"tokens": 0, "bytes": 0, "reserved_bytes": 0}
                                             for t in ("device", "host", "disk")}
        tiers["device"]["index_bytes"] = tiers["device"]["recall_bytes"] = 0
        for engine in self._engines:
            engine.settle_counts()
            for tier, numbers in engine.usage().items():
                for key, value in numbers.items():
                    tiers[tier][key] += value
        if self._shared.disk_store is not None:
            tiers["disk"]["reserved_bytes"] += self._shared.disk_store.file_bytes()
        c = self.counters
        moved = c.pages_recalled["host"] + c.pages_recalled["disk"]
        on_demand = moved - c.pages_prefetched
        wait = c.disk_wait_seconds + c.copy_wait_seconds + self._shared.copy_wait_seconds()
        ahead = [e.readahead for e in self._engines if e.readahead is not None]
        rings = [c.rings_closed, *(r.counts() for r in ahead)]   # those let go at close too: their history
        ring = {name: sum(r[name] for r in rings) for name in c.rings_closed}
        hits, misses = ring["hits"], ring["misses"]
        graphs = [e.graphs for e in self._engines if e.graphs is not None]
        fetching = [e.prefetch_graphs for e in self._engines if e.prefetch_graphs is not None]
        windows = self._state.windows
        if self._engines:
            seen = self._engines[0].seen
        else:
            seen = windows[0].cumulative_length if windows else 0
        s = self.settings
        return {
            **tiers,
            "tokens_seen": seen,
            "layers": len(self._engines),
            "window": {"layers": len(windows), "tokens": sum(w.tokens() for w in windows),
                       "bytes": sum(w.nbytes() for w in windows), "disk_bytes": sum(w.disk_bytes() for w in windows)},
            "kv_heads": s.shape.num_kv_heads,
            "budget_tokens_per_head": {"device": s.device_tokens(seen), "host": s.host_tokens(seen)},
            "bytes_moved": dict(c.bytes_moved),
            "pages_recalled": c.pages_recalled["host"] + c.pages_recalled["disk"],
            "pages_recalled_from": dict(c.pages_recalled),
            "recall_steps": c.recall_steps,
            "pages_reused": c.pages_reused,
            # the share of chosen pages already on the device when chosen (kept from the step before, or
            # prefetched after it): how well the device's content predicted the choice
            "reuse_rate": (c.pages_reused / (c.pages_reused + on_demand)) if c.pages_reused + on_demand else None,
            "prefetch": {"pages": c.pages_prefetched, "used": c.prefetch_used,
                         "hit_rate": c.prefetch_used / c.pages_prefetched if c.pages_prefetched else None},
            # decode steps whose attention and recall ran as launches only, from the layers' own graphs: replayed
            # from a captured CUDA graph, or run eagerly; and why capture is off in the cache, if one failed (the
            # steps a `DecodeGraph` plans whole are counted, and its failures kept, in `DecodeGraph.stats()`)
            "cuda_graphs": {"captures": sum(g.captures for g in graphs), "replays": sum(g.replays for g in graphs),
                            "eager_steps": sum(g.eager for g in graphs), "failed": self._shared.graphs.failed,
                            # the prefetches' launches, replayed on their side stream likewise
                            "prefetch": {"captures": sum(g.captures for g in fetching),
                                         "replays": sum(g.replays for g in fetching),
                                         "eager": sum(g.eager for g in fetching)}},
            # disk pages recall brought up that the host tier kept, and host pages moved down to their clean copy
            "promotion": {"pages": c.pages_promoted, "moved_down_unwritten": c.pages_dropped_clean,
                          # rounds stopped by a full disk or no memory (each move all or nothing)
                          "rounds_skipped": c.promotions_skipped},
            # moves of host pages to disk that the disk refused (full, failing): the pages stayed on the host,
            # over its budget, with the same answers; the last reason
            "spills_deferred": {"rounds": c.spills_deferred, "last_error": c.spill_error},
            "tokens_dropped": c.tokens_dropped,
            "demotions": c.demotions,
            "tokens_masked": c.tokens_masked,
            "transfer_wait_seconds": wait,
            "read_ahead": {"hits": hits, "misses": misses, "pages_read_ahead": ring["pages_read_ahead"],
                           "hit_rate": hits / (hits + misses) if hits + misses else None,
                           "pages_held": sum(r.pages() for r in ahead),
                           # layer steps that skipped reading ahead: where it did not pay (a disk that answers
                           # from the page cache), it pauses for a while
                           "steps_paused": ring["steps_paused"]},
            "parked": self.parked,
            # parked layers read back ahead of their restore (`prefetch_parked`): those restored from such reads, the
            # reads that failed (made again by the restore), the seconds restores waited for reads under way, and
            # what reads not yet taken hold
            "resume_prefetch": {"layers": c.layers_read_before_resume, "failed": c.resume_reads_failed,
                                "wait_seconds": c.resume_wait_seconds,
                                "in_flight": self._state.reads is not None and not self._state.reads.done(),
                                "held_bytes": 0 if self._state.reads is None else self._state.reads.held_bytes()},
            "mode": s.mode,
            "scorer": s.scorer_name,
        }

    # ------------------------------------------------------------------ copies
    def __deepcopy__(self, memo: dict) -> TieredCache:
        """An independent copy (every tier copied into the copy's own pools and disk store): prefill a shared
        prompt once, then continue copies of it. The model config is shared, not copied."""
        self._state.check()
        s = self.settings
        try:   # a scorer may keep state (a generator, a learned model): the copy gets its own
            scorer = copy.deepcopy(self.scorer, memo)
        except Exception as e:
            raise UnsupportedError(f"copy.deepcopy of this TieredCache needs a copy of its scorer "
                                   f"{s.scorer_name!r}, which failed ({type(e).__name__}: {e}); allowed: scorers "
                                   "that copy.deepcopy can copy") from e
        new = TieredCache(self.model_config, device_budget=s.device_budget.value,
                          host_budget=None if s.host_budget is None else s.host_budget.value, disk_dir=s.disk_dir,
                          scorer=scorer, mode=s.mode, recall_pages=s.recall_pages,
                          prefetch_pages=s.prefetch_pages, retain_pages=s.retain_pages, page_size=s.page_size,
                          sink_tokens=s.sink_tokens, recent_tokens=s.recent_tokens, demote_pages=s.demote_pages,
                          cuda_graphs=s.cuda_graphs, read_ahead=s.read_ahead,
                          promote=s.promote)
        try:
            with plain_tensors():   # the copy's tiers are written by its later steps, maybe outside inference mode
                self._copy_layers_into(new, memo)
            clone_counters(self.counters, new.counters)
            new.counters.copy_wait_seconds += self._shared.copy_wait_seconds()
        except BaseException as e:
            new.close()
            if is_resource_error(e):   # as a step or a park says it: the machine ran short, in words
                raise CapacityError(f"copy.deepcopy could not copy the cache: {os_reason(e)}") from e
            raise
        memo[id(self)] = new
        return new

    def _copy_layers_into(self, new: TieredCache, memo: dict) -> None:
        for mine, theirs in zip(self.layers, new.layers):
            if isinstance(mine, TieredLayer):
                copy_layer(mine.engine, theirs.engine)
                theirs.is_initialized = mine.is_initialized
            elif isinstance(mine, WindowLayer):
                if mine.parked:
                    raise UnsupportedError("copy.deepcopy of a parked TieredCache; call cache.resume() first")
                state = {k: v for k, v in vars(mine).items() if k != "_state"}
                vars(theirs).update(copy.deepcopy(state, memo))

    def __copy__(self) -> TieredCache:
        raise UnsupportedError("copy.copy of a TieredCache would share its tiers with the original; allowed: "
                               "copy.deepcopy(cache) for an independent copy")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise UnsupportedError("a TieredCache cannot be pickled: it holds device pools, pinned memory and open "
                               "files; allowed: copy.deepcopy(cache) in the same process, or park() it")

    def close(self) -> None:
        """Release pools, close and delete disk files (also done at exit and when collected)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._state.closed

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def detach_attention(self) -> None:
        """Give the model back its own attention implementation: on the model's config, so for every TieredCache of
        that model (their next step then refuses to go on; a new TieredCache routes the attention again)."""
        restore_attention(self.model_config)


def _check_config(config: Any) -> None:
    """Refuse, naming it, what is not a model's config (the model itself is the usual slip)."""
    if isinstance(config, torch.nn.Module):
        raise ConfigError(f"config is a model ({type(config).__name__}); allowed: the model's config, model.config")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if not isinstance(getattr(text, "num_hidden_layers", None), int):
        raise ConfigError(f"config of type {type(config).__name__} has no num_hidden_layers; allowed: the model's "
                          "config (model.config, a transformers PreTrainedConfig)")


def _folder(disk_dir: Any) -> str | None:
    """`disk_dir` as a path string, refused by name where it is no folder path."""
    path = os.fspath(disk_dir) if isinstance(disk_dir, (str, os.PathLike)) else disk_dir
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"disk_dir={disk_dir!r}; allowed: a folder path (str or os.PathLike of str) or None")
    if path:   # made absolute now: a later os.chdir must not move the cache's files
        path = os.path.abspath(path)
    return path


def _scorer_class(name: str) -> Any | None:
    """The class a scorer name resolves to (None when unknown: `make_scorer` then says so)."""
    import importlib
    from importlib.metadata import entry_points

    from ..scoring.registry import _BUILTIN

    try:
        if name in _BUILTIN:
            module_path, class_name = _BUILTIN[name]
            return getattr(importlib.import_module(module_path), class_name)
        found = [ep for ep in entry_points(group="kvtier.scorers") if ep.name == name]
        return found[0].load() if found else None
    except Exception:   # a broken plugin: make_scorer reports it
        return None


def _check_scorer_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """Refuse `scorer_kwargs` keys the scorer does not take, naming the key and the allowed ones."""
    cls = _scorer_class(name)
    if cls is None or not kwargs:
        return
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    allowed = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                    inspect.Parameter.KEYWORD_ONLY)]
    unknown = [key for key in kwargs if key not in allowed]
    if unknown:
        raise ConfigError(f"scorer_kwargs key {unknown[0]!r} is not a setting of scorer {name!r}; allowed: "
                          f"{', '.join(map(repr, allowed)) or 'none (the scorer takes no settings)'}")


def cache_kwargs(cache: Cache) -> dict[str, Cache]:
    """The keyword this transformers version expects for a cache: ``cache=`` from 5.24, else ``past_key_values=``.

    ``model.generate(ids, **cache_kwargs(cache))`` runs without deprecation warnings on both.
    """
    return {"cache": cache} if _CACHE_KEYWORD else {"past_key_values": cache}


_CACHE_KEYWORD = Version(transformers.__version__).release >= (5, 24)
