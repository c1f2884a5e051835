"""The cache layers a `TieredCache` hands to transformers, and the state they share.

`TieredLayer` forwards a full-attention layer to its `LayerEngine`; sliding-window layers are
transformers' own (`WindowLayer`). Every layer goes through the same guard: a closed or broken cache refuses
use, a step that fails once some layer took it marks the cache broken, and raw resource failures become
`CapacityError`s that name what ran out.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from ..engine.layer import LayerEngine
from ..engine.resources import SharedResources
from ..engine.steady_step import SteadyStep, StepMismatch
from ..engine.unpark import ParkedReads, ahead
from ..errors import (BrokenCacheError, CapacityError, ClosedCacheError, ConfigError, UnsupportedError,
                      is_resource_error, os_reason)
from ..switches import check_switches
from .attention import attention_routed, claim, masked_new_tokens
from .layers import WindowLayer
from .mask_reads import MaskVerdicts


_ROUTE = ("so demoted entries would never be recalled; build the TieredCache with the model's own config "
          "(model.config), not a copy of it (e.g. copy.deepcopy(model.config)), do not change the model's "
          "attn_implementation after building the cache, and call detach_attention() only when no TieredCache of the "
          "model will step again (it acts on the model's config, which they share)")


class CacheState:
    """What a cache's layers and its finalizer share: the engines, the window layers, the shared resources and
    whether the cache is closed or broken. Never the cache itself, so a dropped cache is collected."""

    def __init__(self, engines: list[LayerEngine], windows: list[GuardedWindow], shared: SharedResources,
                 first: int = 0) -> None:
        self.engines, self.windows, self.shared = engines, windows, shared
        self.first = first                  # the model's first layer that stores entries: a step starts there
        self.closed = False
        self.broken: str | None = None     # what failed, in words (no exception is kept: it would hold frames)
        self.pid = os.getpid()
        self.reads: ParkedReads | None = None   # parked layers being read ahead of their restore
        self.config: Any = None   # the model config whose attention the cache routed through kvtier
        self.attended = False     # whether any step's attention came through kvtier (`TieredLayer.attend`)

    def check(self) -> None:
        """Raise unless the cache can be used."""
        self.check_process()
        if self.closed:
            raise ClosedCacheError("this TieredCache is closed: it holds nothing and takes nothing any more "
                                   "(stats() still answers); make a new TieredCache")
        if self.broken is not None:
            raise BrokenCacheError(f"this TieredCache is broken: {self.broken}; its layers may disagree on "
                                   "their length, so it refuses to go on; call reset() to empty it and start "
                                   "again (or close() it)")

    def check_process(self) -> None:
        """Refuse a forked child: the cache's disk file, I/O threads and device memory are its parent's, and a step
        or a reset there would write or remove the parent's pages and files."""
        if os.getpid() != self.pid:
            raise UnsupportedError(f"this TieredCache was made in process {self.pid} and this is process "
                                   f"{os.getpid()} (a fork of it): its disk file, I/O threads and device memory are "
                                   "the parent's; allowed: a new TieredCache made in this process")

    def break_with(self, what: BaseException | str, where: str = "") -> None:
        if self.broken is None:
            text = what if isinstance(what, str) else f"{type(what).__name__}: {what}"
            self.broken = f"{where}failed ({text})" if where else text

    def check_lengths(self) -> None:
        """Break the cache (and say so) where the layers disagree on their length: a step was cut short between
        layers (Ctrl-C), so that some took it and some did not."""
        if len(self.lengths()) > 1:
            self.break_with(f"the layers disagree on their length ({sorted(self.lengths())} tokens): an earlier "
                            "step was interrupted between layers, or did not reach the last ones (a model of fewer "
                            "layers than the config the cache was made for)")
            self.check()

    def lengths(self) -> set[int]:
        """Tokens seen by each layer (0 for a layer that never took a step: a first step interrupted between
        layers shows as two lengths too)."""
        return {e.seen for e in self.engines} | {w.cumulative_length for w in self.windows}

    def step(self, layer_idx: int, before: int, key_states: torch.Tensor, run: Callable[[], Any],
             layer: str, action: str) -> Any:
        """A layer taking a step: the cache must be usable, at the first layer every layer must agree on its
        length, the step must be one sequence; then `run()` under `guard` (`before`: the layer's length; `layer`
        and `action` word the errors)."""
        self.check()
        if layer_idx == self.first:
            self.check_lengths()
        if key_states.dim() == 4 and key_states.shape[0] != 1:
            raise batch_refusal(key_states.shape[0])
        if layer_idx == self.first:   # a switch misspelt since the cache was made: refused before any layer moves
            check_switches()
        if layer_idx == self.first and self.config is not None and not attention_routed(self.config):
            # routed back (`detach_attention`, or attn_implementation set anew): the step's attention would read
            # the device's entries only
            raise UnsupportedError(f"the model's attention no longer runs through kvtier, {_ROUTE}")
        if layer_idx == self.first and self.parked():
            # every parked layer back before any takes the step: a restore that fails then leaves each layer's
            # length as it was (the cache not broken, the step free to be tried again), where a later layer's
            # failing after the first ones had taken the step would break it
            self.guard(self.restore_all, "restoring a parked layer ", "a parked layer could not be restored",
                       before=before)
        return self.guard(run, f"{layer} {action} ", f"{layer} could not take the step", before=before)

    def parked(self) -> bool:
        return any(e.parked is not None for e in self.engines) or any(w.parked for w in self.windows)

    def start_reads(self) -> bool:
        """Start reading the layers parked on disk on a thread (`ParkedReads`), and filling new host slabs for those
        parked on the host without theirs, unless reads are under way, there is nothing to do ahead or no thread can
        be started (the restore then does it itself); returns whether they started."""
        if self.reads is not None or not (any(ahead(e) for e in self.engines) or
                                          any(w.stored is not None for w in self.windows)):
            return False
        self.reads = ParkedReads(self.engines, self.windows)   # held before its thread starts (see `ParkedReads.start`)
        try:
            self.reads.start()
        except RuntimeError:   # "can't start new thread": a head start, never needed
            self.reads = None
            return False
        return True

    def drop_reads(self) -> None:
        """Stop reading ahead and let what was read go (the layers are about to be emptied or closed)."""
        if self.reads is not None:
            self.reads.cancel()   # kept until the thread has stopped: an interruption here leaves it to a later call
            self.reads = None

    def restore_all(self) -> None:
        """Bring every parked layer back (each all or nothing: one that fails stays parked, those before it are
        back, and no layer's length moves); a resource failure is a `CapacityError` naming the layer. Layers read
        ahead (`start_reads`) take what was read; the others, and those whose read failed, are read now."""
        reads, counters = self.reads, self.shared.counters
        if reads is not None:
            counters.resume_wait_seconds += reads.wait()   # kept until the thread has stopped, as in `drop_reads`
            counters.resume_reads_failed += reads.failed
            self.reads = None   # a restore that fails reads its layers again when tried again
        for window in self.windows:
            got = None if reads is None else reads.take(window, window.stored)
            try:
                window.restore(got)
                counters.layers_read_before_resume += int(got is not None)
            except BaseException as e:
                err = capacity_error(e, f"window layer {window.layer_idx} could not be restored")
                if err is None:
                    raise
                raise err from e
        for engine in self.engines:
            got = None if reads is None else reads.take(engine, engine.parked)
            try:
                engine.restore(got)
                counters.layers_read_before_resume += int(got is not None)
            except BaseException as e:
                if engine.torn:
                    self.break_with(e, f"restoring layer {engine.layer_idx} was interrupted midway and ")
                err = capacity_error(e, f"layer {engine.layer_idx} could not be restored")
                if err is None:
                    raise
                raise err from e

    def undo_windows(self) -> None:
        """Give the window layers that took this step before the first tiered layer their state before it (the
        step was refused there, before anything else changed)."""
        for window in self.windows:
            window.undo()

    def settle_windows(self) -> None:
        """The step got past the first tiered layer's checks: the windows' states before it are not needed."""
        for window in self.windows:
            window.before = None

    def guard(self, run: Callable[[], Any], where: str, capacity: str, before: int | None = None) -> Any:
        """`run()` without autograd; a failure breaks the cache if any layer's length moved (always, when
        `before` is None: the layer already took the step), and a resource failure becomes a `CapacityError`."""
        try:
            with plain_tensors():
                return run()
        except BaseException as e:
            if before is None or any(n != before for n in self.lengths()):
                self.break_with(e, where)
            err = capacity_error(e, capacity)
            if err is None:
                raise
            raise err from e


def plain_tensors() -> contextlib.AbstractContextManager:
    """Where the cache changes what it keeps: no autograd (stored entries never carry a graph), and plain tensors
    even under inference mode, so that they can be written later outside it (the next step, stats, reset)."""
    inference = torch.is_inference_mode_enabled()
    if not inference and not torch.is_grad_enabled():   # as a model's step runs (`generate`, `no_grad`)
        return contextlib.nullcontext()
    return _outside_inference() if inference else torch.no_grad()


@contextlib.contextmanager
def _outside_inference():
    with torch.no_grad(), torch.inference_mode(False):
        yield


def capacity_error(e: BaseException, what: str) -> CapacityError | None:
    """A raw resource failure (OSError, MemoryError, no thread) as a `CapacityError`; None for other errors."""
    return CapacityError(f"{what}: {os_reason(e)}") if is_resource_error(e) else None


def batch_refusal(batch: int) -> UnsupportedError:
    """The error for a step of more than one sequence, naming the `generate` feature that asked for it."""
    feature = _generate_feature()
    asked = f"{feature} (a batch of {batch} sequences)" if feature else f"batch size {batch}"
    return UnsupportedError(f"{asked} is not supported: a TieredCache holds one sequence; allowed: batch size "
                            "1 with greedy or sampling generation (num_beams=1, num_return_sequences=1)")


def _generate_feature() -> str | None:
    """What the running transformers ``generate`` call asked for that needs several sequences, if any.

    Read from the generation config of the ``generate`` frame on the stack, only to word an error.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "generate" and \
                str(frame.f_globals.get("__name__", "")).startswith("transformers.generation"):
            gc = frame.f_locals.get("generation_config")
            beams = getattr(gc, "num_beams", 1) or 1
            returned = getattr(gc, "num_return_sequences", 1) or 1
            if beams > 1:
                return f"beam search (num_beams={beams})"
            if returned > 1:
                return f"num_return_sequences={returned}"
            return None
        frame = frame.f_back
    return None


class OneSequence:
    """What generate may ask of a cache or a layer that needs several sequences or a rollback: refused, by
    name, before anything changes."""

    def crop(self, tokens_to_remove: int) -> None:
        raise crop_refusal(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if beam_idx.numel() != 1 or int(beam_idx.reshape(-1)[0]) != 0:
            raise UnsupportedError("beam search is not supported by TieredCache (it holds one sequence); "
                                   "allowed: num_beams=1")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise batch_refusal(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if indices.numel() != 1 or int(indices.reshape(-1)[0]) != 0:
            raise UnsupportedError("batch_select_indices: a TieredCache holds one sequence; allowed: index 0")

    def activate_past_recording(self, **options: object) -> None:
        # transformers passes options here that change between releases (recurrent_states_to_keep since 5.25);
        # whatever they are, the answer is the same refusal
        raise UnsupportedError("assisted decoding is not supported by TieredCache: it rolls the cache back, and "
                               "demoted pages cannot be un-taken; allowed: generation without an assistant model")


def crop_refusal(tokens_to_remove: int) -> UnsupportedError:
    return UnsupportedError(f"crop({tokens_to_remove}) is not supported by TieredCache: assisted and speculative "
                            "decoding roll the cache back, and demoted pages cannot be un-taken; allowed: greedy "
                            "or sampling generation without an assistant model")


class TieredLayer(OneSequence, CacheLayerMixin):
    """One full-attention layer of a `TieredCache`; forwards to its `LayerEngine`.

    A step that fails after some layers took it (an exception out of `update`, `attend` or `commit` once a
    layer's length moved) marks the cache broken; a failure before anything changed (a bad shape) does not.
    ``keys``/``values`` are copies of the device tier's entries (``[1, kv_heads, n, head_dim]``, storage
    order; `positions` says which tokens they are); demoted entries are not in them.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False
    # set while the model runs a decode step planned whole (`kvtier.integrations.model_graph`): `update`, `attend`
    # and `commit` then issue its launches only, and change nothing on the host
    steady: SteadyStep | None = None
    _steady_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, engine: LayerEngine, state: CacheState | None = None) -> None:
        super().__init__()
        self.engine = engine
        self._state = state if state is not None else CacheState([engine], [], engine.shared, engine.layer_idx)

    # ------------------------------------------------------------------ entries
    def _entries(self, which: int) -> torch.Tensor | None:
        engine = self.engine
        if engine.parked is not None:
            raise UnsupportedError(f"layer {engine.layer_idx} is parked in {engine.parked.where} memory: its "
                                   "entries are off the device; call cache.resume() first")
        if engine.pool is None or not self.is_initialized:
            return None   # no step yet, or none since a reset (transformers' own layers hold None then too)
        return engine.pool.contiguous(engine.pool.count)[which].clone()

    @property
    def keys(self) -> torch.Tensor | None:
        return self._entries(0)

    @keys.setter
    def keys(self, value: Any) -> None:
        if value is not None:
            raise UnsupportedError("a TieredLayer's keys cannot be assigned: its entries live in kvtier's tiers; "
                                   "allowed: reading them")

    @property
    def values(self) -> torch.Tensor | None:
        return self._entries(1)

    @values.setter
    def values(self, value: Any) -> None:
        if value is not None:
            raise UnsupportedError("a TieredLayer's values cannot be assigned: its entries live in kvtier's "
                                   "tiers; allowed: reading them")

    @property
    def positions(self) -> torch.Tensor | None:
        """Token positions ``[kv_heads, n]`` of the entries in `keys`/`values`."""
        if self._entries(0) is None:
            return None
        return self.engine.pool.meta()[0].clone()

    # ------------------------------------------------------------------ a step
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        engine = self.engine
        if self.steady is not None:   # a planned step: the model's keys and values go to its launches
            self._steady_kv = (key_states, value_states)
            keys = self.steady.placeholder
            claim(keys[0], keys[1], self)
            return keys
        keys, values = self._state.step(engine.layer_idx, engine.seen, key_states,
                                        lambda: engine.write(key_states, value_states), f"layer {engine.layer_idx}",
                                        "write")
        self.is_initialized = True
        claim(keys, values, self)   # the attention function calls `attend` and `commit` below
        return keys, values

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None = None,
               refuse: list[str] | None = None, **how: Any) -> Any:
        """The engine's `attend` (keywords: `scaling`, `softcap`, `sinks`, `weights`), after telling it which
        new tokens the mask leaves out (left padding); a failure breaks the cache (this layer took the step).

        `refuse` names what the model asked of its attention that the split attention cannot do; it is refused
        when this step recalls (otherwise the model's own attention runs and does it).
        """
        engine = self.engine
        self._state.attended = True
        first = engine is self._state.engines[0]   # the first tiered layer: a refusal here can undo the step
        step = self.steady
        if step is not None:   # a planned step's launches (`kvtier.integrations.model_graph`); the mask is causal
            if first:
                self._state.settle_windows()
            if refuse or how.get("weights"):   # what the ordinary step does (or refuses) instead
                raise StepMismatch(f"layer {engine.layer_idx}'s attention was asked for "
                                   f"{refuse[0] if refuse else 'its weights'}")
            scaling = how.get("scaling")
            scale = query.shape[-1] ** -0.5 if scaling is None else scaling
            k, v = self._steady_kv
            # no layer's length moves while the model runs a planned step: whether a failure breaks the cache
            # is for `DecodeGraph` to say, from which layers launched
            return self._state.guard(
                lambda: (engine.steady_launches(step, query, k, v, scale, how.get("softcap"), how.get("sinks")), None),
                f"layer {engine.layer_idx} attention ", f"layer {engine.layer_idx} could not recall its pages",
                before=engine.seen)

        def run() -> Any:
            pending = engine.pending
            if pending is not None:
                try:
                    if engine.recalls():
                        if refuse:
                            raise UnsupportedError(f"layer {engine.layer_idx}'s attention was asked for {refuse[0]}, "
                                                   "which kvtier's split attention over recalled pages cannot apply")
                        check_plain_mask(attention_mask)
                        check_causal_mask(attention_mask, pending.k.shape[2])
                    masked = masked_new_tokens(attention_mask, engine.pool.count, pending.k.shape[2])
                    if masked is not None:
                        engine.mask_new_tokens(masked)
                except UnsupportedError:
                    if first:   # only window layers before it took the step: undo it there and here
                        engine.drop_step()
                        self._state.undo_windows()
                    raise
            if first:
                self._state.settle_windows()
            return engine.attend(query, **how)

        before = None if engine.pending is None else engine.pending.start
        return self._state.guard(run, f"layer {engine.layer_idx} attention ",
                                 f"layer {engine.layer_idx} could not recall its pages", before=before)

    def commit(self, query: torch.Tensor | None = None, scaling: float | None = None,
               softcap: float | None = None) -> None:
        """The engine's `commit`; a failure breaks the cache (this layer already took the step)."""
        if self.steady is not None:   # taken by `take_steady` once the step's launches are queued
            return
        self._committing(lambda: self.engine.commit(query, scaling, softcap))

    def demote_after_steady(self) -> None:
        """The engine's `demote_after_steady` (the end of a planned step's commit), guarded as `commit` is."""
        self._committing(self.engine.demote_after_steady)

    def _committing(self, run: Callable[[], None]) -> None:
        i = self.engine.layer_idx
        self._state.guard(run, f"layer {i} commit ", f"layer {i} could not place the step's entries")

    def get_seq_length(self, *args: Any) -> int:
        return self.engine.seen

    def get_mask_sizes(self, query_length: int | torch.Tensor, *args: Any) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older API passed cache_position
            query_length = query_length.shape[0]
        st, engine = self._state, self.engine
        if st is not None:
            st.check()   # a broken cache says so first
        pending = engine.pending
        if pending is not None and pending.start == engine.seen and not pending.placed:
            engine.drop_step()   # a step cut short (Ctrl-C) before its length moved: it was never taken
        elif pending is not None:
            if st is not None:
                st.check_lengths()   # cut short between layers: the cache says so
            # a model is about to run a step, but the last step's attention never came through kvtier (which
            # places the step and recalls demoted pages): answers would silently lose the demoted entries
            if st is not None and not st.attended:   # on no step so far: most likely the architecture's own code
                raise UnsupportedError(
                    "the model's attention has not run through kvtier on any step: its architecture computes "
                    "attention in its own code rather than through transformers' attention interface (as MPT, "
                    "XGLM and JetMoE do), or the cache was built with a copy of the model's config; kvtier could "
                    "never recall a demoted entry for it; allowed: architectures whose attention goes through the "
                    "interface, with the cache built from model.config")
            raise UnsupportedError(f"the model's attention did not run through kvtier on the last step, {_ROUTE}")
        engine.flush()
        stored = engine.stored
        return stored + int(query_length), engine.seen - stored

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length

    def reset(self) -> None:
        self.engine.reset()
        self.is_initialized = False   # as transformers' layers: some models read it to tell their first step

    def offload(self) -> None:  # the tiers do their own moving
        return None

    def prefetch(self) -> None:
        return None



_BIASED = MaskVerdicts()   # whether a mask adds biases, read once per mask (every layer gets the same one)


def check_plain_mask(mask: torch.Tensor | None) -> None:
    """Refuse a float mask that adds biases (ALiBi, relative positions): the split attention applies no mask."""
    if mask is None or mask.dtype == torch.bool or mask.dim() != 4:
        return
    low = torch.finfo(mask.dtype).min / 2
    if _BIASED.verdict(mask, lambda m: ((m != 0) & (m > low)).any()):
        raise UnsupportedError("the attention mask adds position biases (ALiBi or relative-position terms); "
                               "kvtier's split attention over recalled pages cannot apply them; allowed: models "
                               "whose mask only allows or blocks entries (rotary and other position encodings "
                               "applied to the keys are fine)")


_CAUSAL = MaskVerdicts()   # whether a mask is causal over the stored entries and the new tokens


def check_causal_mask(mask: torch.Tensor | None, q_len: int) -> None:
    """Refuse a 4D mask of several new tokens that is not causal (new tokens that see later ones, as a
    bidirectional block does, or stored entries hidden from some rows): the split attention over recalled pages
    applies causality only. Padding columns (hidden from every row) are `masked_new_tokens`' to judge; a decode
    step's one row has nothing else to get wrong."""
    if mask is None or mask.dim() != 4 or q_len < 2:
        return

    def causal(m: torch.Tensor) -> bool:
        allowed = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
        allowed = allowed[..., -q_len:, :]
        seen = allowed.any(dim=-2, keepdim=True)   # padding: a column no row sees is judged elsewhere
        # the new tokens are the last columns, whatever came before them (kvtier's stored entries, or every
        # token seen, as a mask made for DynamicCache has it)
        want = torch.ones(q_len, allowed.shape[-1], dtype=torch.bool, device=m.device)
        want[:, -q_len:] = torch.ones(q_len, q_len, dtype=torch.bool, device=m.device).tril_()
        return bool(((allowed != want) & seen).logical_not().all())

    if not _CAUSAL.verdict(mask, causal):
        raise UnsupportedError("the attention mask is not causal (new tokens that see later ones, as a "
                               "bidirectional block does, or stored entries hidden from some queries); kvtier's "
                               "split attention over recalled pages applies causality only; allowed: causal masks, "
                               "with left padding")


class GuardedWindow(OneSequence, WindowLayer):
    """A sliding-window layer under the cache's guard (closed, broken, one sequence, interrupted steps)."""

    def __init__(self, sliding_window: int, layer_idx: int, state: CacheState | None = None,
                 **kwargs: Any) -> None:
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.layer_idx = layer_idx
        self._state = state
        # before this step, where the layer comes before the first tiered one (whose checks may refuse the step):
        # transformers' update makes new tensors, so holding the old ones is enough to undo it
        self.before: tuple | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        st = self._state
        if st is None:
            raise ConfigError("a window layer of a TieredCache used before the cache was built")

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            if st.engines and self.layer_idx < st.engines[0].layer_idx:
                self.restore()
                self.before = (self.keys, self.values, self.cumulative_length, self.is_initialized)
            return WindowLayer.update(self, key_states, value_states, *args, **kwargs)

        return st.step(self.layer_idx, self.cumulative_length, key_states, run, f"window layer {self.layer_idx}",
                       "update")

    def undo(self) -> None:
        """Back to the state before this step's update (`before`), if one is kept."""
        if self.before is not None:
            self.keys, self.values, self.cumulative_length, self.is_initialized = self.before
            self.before = None

    def reset(self) -> None:
        super().reset()
        self.before = None

    def park(self, to: str = "host", path: str | None = None) -> None:
        self.before = None
        super().park(to, path)
