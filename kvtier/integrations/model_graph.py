"""A model's decode step with a `TieredCache`, replayed from one CUDA graph: the model's launches and the cache's.

With the cache's own work replayed layer by layer (`cuda_graphs`), a decode step on a GPU is still bound by the
host: the model's own launches, some twenty a layer, each cost the host its Python and dispatch, as they do with
`DynamicCache`, while the GPU work behind them is small (at 10% of a long context on the device, reading the
weights is most of it). `DecodeGraph` captures the whole step, the model's forward with every layer's
attention and recall, once per state, and replays it: the host then only plans each layer's step
(`kvtier.engine.steady_step`: a few checks and the key) and takes it after.

A step is replayed where it is *steady* in every layer (recall planned on the device, no page on disk, no slab
added; `LayerEngine.plan_steady`): nearly every step of a long decode. A step that demotes is one too: its launches
are those of the steps before it, and the demotions follow the replay, layer by layer, as the ordinary steps'
commits would have made them. Any other step (the prefill, a step on a CPU's path where recall is planned on the
host, one on a layer with disk pages, which reads its choice back, one that adds a slab) runs the ordinary way,
and so does everything where
graphs cannot be captured (a CPU, `cuda_graphs=False`, a capture that failed: then the planned steps run their
launches eagerly, the same bits). The first state is captured the second step it is seen (its first step, run on
the capture stream, warms up what the model's launches set up lazily); later ones, from the step after a
demotion, the first step they are seen (`StepGraphs.at_once`): a state lasts until the next demotion, some
seventy steps at the default settings, and each step it waits to be captured runs every launch one by one.

What a replay bakes in besides the cache's state: the model's weights where they lie (a model cast, or its
weights reallocated on its device, after a capture is captured again; one moved to another device runs every
step the ordinary way, and needs a new `DecodeGraph`; its modules are those it had when the `DecodeGraph` was
made), the token and its position, copied into the graph's inputs. The step's
attention mask is a ready one that no layer reads: a decode step's own token is never padding, and a prompt's
padding was never stored (so `generate`'s 2D mask is left aside, its positions taken); models with layers kvtier
does not tier (sliding windows) run the ordinary way.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..engine.graphs import GraphSwitch, StepGraphs, StepKey
from ..engine.steady_step import StepMismatch
from ..errors import ConfigError, UnsupportedError
from ..switches import check_switches
from .hf import TieredCache, cache_kwargs

# what `generate` passes a forward call that a step taken by `DecodeGraph` reads (or may leave aside)
_TAKEN = ("input_ids", "attention_mask", "position_ids", "cache", "past_key_values")


@contextlib.contextmanager
def _uncached_autocast() -> Any:
    """Autocast's cache of cast weights off for a planned step: a graph captured from casts the cache held would
    keep reading them after the autocast region that made them ends and frees them (torch refuses to capture
    with that cache on for the same reason). The casts give the same values either way."""
    if not torch.is_autocast_cache_enabled():
        yield
        return
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(True)


class DecodeGraph:
    """Decode steps of `model` over `cache`, each a CUDA graph's replay where the step is steady.

    ``logits = step(token)``: ``token`` ``[1, 1]`` int64 on the model's device (and its ``position_ids``, by
    default the cache's length); returns the step's logits ``[1, 1, vocab]`` (a replay's own tensor, rewritten by
    the next step: copy it to keep it). A prompt (more than one token) runs the ordinary way.
    ``step.generate(input_ids, **kwargs)`` is ``model.generate`` over the cache with its steps taken so.
    `enabled=False` (or a cache made with ``cuda_graphs=False``) captures nothing: steady steps then run their
    launches eagerly.
    """

    def __init__(self, model: torch.nn.Module, cache: TieredCache, *, enabled: bool = True) -> None:
        if not isinstance(cache, TieredCache):
            raise ConfigError(f"cache={type(cache).__name__}; allowed: a TieredCache")
        if getattr(cache, "model_config", None) is not getattr(model, "config", None):
            raise ConfigError("the TieredCache was built with another config than this model's; allowed: "
                              "TieredCache(model.config, ...) for this model")
        if not isinstance(enabled, bool):
            raise ConfigError(f"enabled={enabled!r}; allowed: True or False")
        self.model, self.cache = model, cache
        params = next(model.parameters(), None)
        self.device = params.device if params is not None else torch.device("cpu")
        # the first state's first step runs on the capture stream (a warm-up of what the model's launches set up
        # lazily), later states are captured at once; a planned step the model calls otherwise than planned is
        # not a capture's failure
        self.graphs = StepGraphs(self.device, enabled and cache.settings.cuda_graphs, GraphSwitch(),
                                 warm_aside=True, passthrough=(StepMismatch,), at_once=True)
        cache._shared.step_graphs.add(self.graphs)   # let go when a layer lets its recall buffer go (park, reset)
        # every module's table of parameters and of buffers (the model's modules as they stand: one replaced
        # later needs a new DecodeGraph)
        self._tables = [table for m in model.modules() for table in (m._parameters, m._buffers) if table]
        self._keyword = "cache_position" in inspect.signature(model.forward).parameters
        with torch.inference_mode(False):   # plain tensors, written by steps inside inference mode and out of it
            self._position = torch.zeros(1, 1, dtype=torch.int64, device=self.device)
            # a planned step's mask where every layer attends through kvtier (which reads none in such a step): a
            # 4D mask is taken as it is, so transformers builds none, which it would otherwise do inside the
            # capture only (a capture counts as tracing there), or through a pageable host copy (eager, 5.17)
            self._mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        self.ordinary = 0   # steps run the ordinary way (a prompt, or a step not steady in some layer)
        self._inside = False

    def stats(self) -> dict[str, Any]:
        """How the steps ran: `replays` (one launch each), `captures`, `eager` (planned, launched one by one),
        `ordinary` (not planned), and why capture is off, if a capture failed."""
        g = self.graphs
        return {"replays": g.replays, "captures": g.captures, "eager": g.eager, "ordinary": self.ordinary,
                "failed": g.failed}

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        """``model.generate(input_ids, **kwargs)`` over the cache, its one-token steps through this `DecodeGraph`
        (replayed where steady), everything else (the prompt, any step with inputs it does not take) as
        transformers runs it. Same tokens and scores as `model.generate` with the cache."""
        if "cache" in kwargs or "past_key_values" in kwargs:
            raise ConfigError("generate() was given a cache; allowed: none (a DecodeGraph generates with its own)")
        model = self.model
        if "forward" in vars(model):
            raise ConfigError("the model's forward is already replaced (a DecodeGraph.generate call within another, "
                              "or another wrapper); allowed: one generate call at a time")
        ordinary = model.forward

        @functools.wraps(ordinary)   # generate reads the forward's signature (whether it takes `logits_to_keep`)
        def forward(*args: Any, **given: Any) -> Any:
            if self._inside:   # `__call__`'s own forward
                return ordinary(*args, **given)
            if args or not self._takes(given.get("input_ids"), given):   # the prompt, say (transformers passes
                self.ordinary += 1                                        # its inputs by name)
                return ordinary(*args, **given)
            token = given["input_ids"]
            if self.cache._state.windows:   # never planned (`_plan`); and its windows keep a prompt's padding,
                self.ordinary += 1          # which only the mask, passed on here, hides
                return ordinary(**given)
            logits = self(token, position_ids=given.get("position_ids"))
            return CausalLMOutputWithPast(logits=logits, **cache_kwargs(self.cache))

        model.forward = forward
        try:
            return model.generate(input_ids, **cache_kwargs(self.cache), **kwargs)
        finally:
            del model.forward

    def _takes(self, token: Any, given: dict[str, Any]) -> bool:
        """Whether a forward call of `generate` is a step `__call__` takes: one token of one sequence over this
        cache, asking for nothing but the logits of that token. Its 2D attention mask is not read: a decode step's
        own token is never padding, and padding in the prompt was never stored (the cache drops it)."""
        if not isinstance(token, torch.Tensor) or token.shape != (1, 1):
            return False
        if given.get("cache", given.get("past_key_values")) is not self.cache:
            return False
        mask = given.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            return False
        for name, value in given.items():
            if name in _TAKEN or value is None:
                continue
            if name in ("use_cache", "return_dict") and value:
                continue
            if name in ("output_attentions", "output_hidden_states") and not value:
                continue
            if name == "logits_to_keep" and value in (0, 1):
                continue
            return False
        return True

    @torch.no_grad()
    def __call__(self, token: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(token, torch.Tensor) or token.dtype not in (torch.int64, torch.int32) or \
                token.dim() != 2 or token.shape[0] != 1:
            what = f"of shape {list(token.shape)} and {token.dtype}" if isinstance(token, torch.Tensor) else \
                f"of type {type(token).__name__}"
            raise ConfigError(f"token {what}; allowed: a [1, n] tensor of integer token ids (batch size 1)")
        if position_ids is not None and not isinstance(position_ids, torch.Tensor):
            raise ConfigError(f"position_ids of type {type(position_ids).__name__}; allowed: a tensor of the token "
                              "ids' shape, or None")
        if position_ids is not None and tuple(position_ids.shape) != tuple(token.shape):
            raise ConfigError(f"position_ids of shape {list(position_ids.shape)} for token ids of shape "
                              f"{list(token.shape)}; allowed: the same shape, or None (the cache's length onwards)")
        self._inside = True   # the model's forward, run by this call, is the model's own (see `generate`)
        try:
            return self._step(token, position_ids)
        finally:
            self._inside = False

    def _step(self, token: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        cache = self.cache
        plans = None
        if token.shape[1] == 1:   # under the cache's guard: what planning makes is kept as plain tensors
            plans = cache._state.guard(self._plan, "planning a decode step ", "a decode step could not be planned",
                                       before=next(iter(cache._state.lengths()), 0))
        if plans is None:
            return self._ordinary(token, position_ids)
        engines = cache._engines
        layers = [cache.layers[e.layer_idx] for e in engines]
        if position_ids is None:
            self._position.fill_(engines[0].seen)
        else:   # left padding: the model's positions count the prompt's tokens, not the padding
            self._position.copy_(position_ids)
        ran: list[bool] = []   # each run of `work` this call: whether it was a capture's (nothing executed)
        captures = self.graphs.captures

        def work(ids: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, ...]:
            ran.append(self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
            for step in plans:   # what a capture that failed noted, this run notes again
                step.launched, step.ids = False, None
            kwargs = {"cache_position": position[0]} if self._keyword else {}
            kwargs["attention_mask"] = self._mask   # every layer attends through kvtier (`_plan`)
            out = self.model(input_ids=ids, position_ids=position, use_cache=True, **kwargs, **cache_kwargs(cache))
            return (out.logits, *(step.ids for step in plans))

        # a state whose step fills some layer's last slab lasts that step (the next adds a slab): not worth a
        # capture at its first step
        lasting = not any(step.fills_slab for step in plans)
        # from the first layer handed its plan until the host takes the step, any failure (Ctrl-C as the launches
        # return included) is `_failed`'s to judge: the launches may have run, the host's part not
        judged: BaseException | None = None   # an error that already says what it did to the cache
        try:
            try:
                for layer, step in zip(layers, plans):
                    layer.steady = step
                with _uncached_autocast():
                    outputs = self.graphs.run(lambda: self._key(plans, token), (token, self._position), work,
                                              lasting=lasting)
            finally:
                for layer in layers:
                    layer.steady = layer._steady_kv = None
            missing = [e.layer_idx for e, ids in zip(engines, outputs[1:]) if ids is None]
            if missing:   # the model's attention did not come through kvtier there
                error = UnsupportedError(
                    f"layer {missing[0]}'s attention did not run through kvtier in a decode step planned whole, so "
                    "its entry was never written; build the TieredCache with the model's own config and keep the "
                    "attention implementation it set (no detach_attention() while decoding)")
                if len(missing) < len(plans):   # the other layers' launches ran: the device is ahead of the host
                    cache._state.break_with(error)
                judged = error   # none launched: nothing changed, even where a capture ran this call
                raise error
            for step, ids in zip(plans, outputs[1:]):
                step.ids = ids
            self._take(plans)
        except StepMismatch as e:
            if self._failed(plans, ran, e, self.graphs.captures > captures):
                raise
            for engine in engines:   # planned from a step unlike this one: plan again after an ordinary one
                engine._steady_how = None
            return self._ordinary(token, position_ids)
        except BaseException as e:
            if e is not judged and not plans[0].taken and cache._state.broken is None:   # (a failed take broke the
                self._failed(plans, ran, e, self.graphs.captures > captures)            # cache itself)
            raise
        return outputs[0]

    def _take(self, plans: list) -> None:
        """Every layer's planned step taken on the host once its launches are queued, then every layer's
        demotion, as the ordinary steps' commits make them (a layer's demotion reads and changes only that
        layer, so it may follow every layer's launches); under the cache's guard, as the ordinary commit is: a
        failure breaks the cache, and a resource's is a `CapacityError`."""
        cache = self.cache

        def take() -> None:
            for engine, step in zip(cache._engines, plans):
                engine.take_steady(step)
            plans[0].taken = True   # the step is the host's now: a failure after this is a demotion's

        cache._state.guard(take, "taking a decode step planned whole ",
                           "a decode step planned whole could not be taken")
        for engine in cache._engines:
            cache.layers[engine.layer_idx].demote_after_steady()

    def _ordinary(self, token: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        self.ordinary += 1
        return self.model(input_ids=token, position_ids=position_ids, use_cache=True,
                          **cache_kwargs(self.cache)).logits

    def _failed(self, plans: list, ran: list[bool], error: BaseException, captured: bool) -> bool:
        """After a planned step failed: whether the cache changed. A replay's or a run's launches that began in
        some layers but not all leave the device ahead of the host: the cache is broken. Where every layer's
        launches were issued (the failure came after them), the steps are taken and the demotions made, as an
        ordinary step that fails after its layers leaves them; where none began, or only a capture ran them,
        nothing changed. `captured`: a capture succeeded in this call, so its replay is what failed."""
        state = self.cache._state
        if not ran or captured:   # the replay: its launches may have run
            state.break_with(error, "a decode step replayed from a CUDA graph ")
            return True
        if ran[-1] or not any(step.launched for step in plans):
            return False
        if all(step.ids is not None for step in plans):
            self._take(plans)
            return True
        launched = sum(step.launched for step in plans)
        state.break_with(error, f"a decode step planned whole, after {launched} of {len(plans)} layers issued "
                                f"their launches, ")
        return True

    def _plan(self) -> list | None:
        """Every layer's planned step, where every layer is tiered and steady, on this device, and nothing else
        stores entries; else None. A layer kvtier does not tier (a sliding window, a layer that shares another's
        entries) attends in the model's own way, from a mask and lengths that the replay would bake in."""
        state = self.cache._state
        state.check()
        check_switches()   # a misspelt switch refused before any layer launches, as an ordinary step refuses it
        if state.windows or not state.engines or len(state.engines) != len(self.cache.layers) \
                or len(state.lengths()) > 1:
            return None
        plans = []
        for engine in state.engines:
            step = engine.plan_steady()
            if step is None or engine.device != self.device:
                return None
            plans.append(step)
        return plans

    def _key(self, plans: list, token: torch.Tensor) -> StepKey:
        """What the step's replay bakes in: every layer's key, the model's weights where they lie, the inputs'
        shapes (their contents are copied in)."""
        kind = self.device.type
        autocast = torch.is_autocast_enabled(kind)
        # where every weight and buffer lies now, read from the modules' own tables: moving or casting a model
        # keeps its parameters with new storage and puts new buffers in those tables
        weights = tuple(t.data_ptr() for table in self._tables for t in table.values() if t is not None)
        held: tuple = (self.model,)
        values: tuple = (weights, token.shape, token.dtype, autocast,
                         torch.get_autocast_dtype(kind) if autocast else None)
        for step in plans:
            held += step.key.held
            values += (len(step.key.held), len(step.key.values), *step.key.values)
        return StepKey(held, values)
