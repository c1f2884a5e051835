"""The scorer contract: rank newly written cache entries once; ranking, budgets and movement live elsewhere.

There are two kinds of scorer, and each object is exactly one of them:

- `Scorer`: ``score(keys, values, positions, layer_idx)``. The cache calls it when entries are written, before
  attention, so it cannot see attention weights (recency, keynorm, keydiff, random, kvp).
- `QueryScorer`: declares ``needs_query = True`` and takes three more keywords, ``query``, ``context_keys``
  and ``scaling``. The cache calls it after the step's attention, with the queries attention used (tova,
  snapkv, h2o).

Shapes:

- ``keys``, ``values``: ``[batch, kv_heads, tokens, head_dim]``, keys post-RoPE as cached, any float dtype
  (scorers compute in float32, so bfloat16 and float32 inputs rank alike);
- ``positions``: ``[tokens]`` int64, the absolute positions of those entries; one tensor is passed to every
  layer of a step, so a scorer reads it and never writes to it. A decode step's is the same tensor every step,
  written anew each step: a scorer that keys what it computed on it keys on the tensor and its version
  (``positions._version``, which every write moves on), as KVP does, not on the tensor alone;
- ``layer_idx``: the layer they belong to (learned scorers keep one agent per layer and head);
- ``query``: ``[batch, q_heads, tokens, head_dim]``, the step's queries (``q_heads`` a multiple of ``kv_heads``);
- ``context_keys``: ``[batch, kv_heads, n, head_dim]``, the device entries (what attention read until pages are
  demoted), the ``tokens`` new ones last; left padding is left out of it and of ``query``, and is not scored. Not
  among them: the pages a step recalls (tier mode, once pages are demoted) and a model's learned sink logits
  (GPT-OSS), so a softmax over them gives the entries somewhat more weight than the model's attention did;
- ``scaling``: the softmax scale attention used;
- ``softcap``: the model's attention logit cap (Gemma 2's ``attn_logit_softcapping``; None where it has none),
  passed only to a `QueryScorer` whose ``score`` takes a ``softcap`` keyword, so that it ranks by the
  attention the model computes;
- the result: ``[batch, kv_heads, tokens]`` floats; higher means more important; ``+inf``/``-inf`` allowed, NaN not.

A scorer may also implement `AgeAware`: its ranking then adds ``age_bias(ages, layer_idx)`` to the scores given at
write time, re-read at every placement, so entries can lose rank as they age (KVP's recency term). Callers
rank through `ranking_scores`, which adds it where present.

A scorer trained for one model shape (KVP) also implements `ModelBound`; the cache calls `check_scorer_model`
before the first step, so a mismatch fails at construction instead of mis-ranking.

Callers ask through `needs_query`, `check_scorer_model`, `scorer_name` and `checked_scores` rather than
probing attributes, so this module is the only place that reads the ``needs_query`` marker.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import ScorerError

_QUERY_KEYWORDS = ("query", "context_keys", "scaling")


def _marker(obj: object) -> bool | None:
    """The ``needs_query`` marker: False when absent, None when it is not a bool."""
    value = getattr(obj, "needs_query", False)
    return value if isinstance(value, bool) else None


class _ScorerKind(type(Protocol)):  # type: ignore[misc]
    """Protocol membership that also reads the marker, so `Scorer` and `QueryScorer` split scorers exactly.

    Structural checks alone cannot tell the two apart: both have ``name`` and ``score``.
    """

    def __instancecheck__(cls, obj: object) -> bool:
        wants_query = _KIND.get(cls)
        if not super().__instancecheck__(obj):
            return False
        return wants_query is None or _marker(obj) is wants_query


@runtime_checkable
class Scorer(Protocol, metaclass=_ScorerKind):
    """Ranks entries from key, value and position, when they are written (before attention)."""

    name: str

    def score(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              layer_idx: int) -> torch.Tensor: ...


@runtime_checkable
class QueryScorer(Protocol, metaclass=_ScorerKind):
    """Ranks entries from the attention they receive, after the step's attention (``needs_query = True``)."""

    name: str
    needs_query: bool

    def score(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, layer_idx: int, *,
              query: torch.Tensor, context_keys: torch.Tensor, scaling: float) -> torch.Tensor: ...


_KIND: dict[type, bool] = {Scorer: False, QueryScorer: True}


@runtime_checkable
class ModelBound(Protocol):
    """A scorer that only fits models of one shape (trained weights); optional."""

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """Raise `ConfigError` naming both shapes when the model is not the one the scorer fits."""
        ...


@runtime_checkable
class AgeAware(Protocol):
    """A scorer whose ranking also depends on each entry's age (tokens written since it); optional."""

    def age_bias(self, ages: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """``ages`` ``[kv_heads, n]`` int64 -> ``[kv_heads, n]`` float32, added to the write-time scores."""
        ...


def ranking_scores(scorer: object, scores: torch.Tensor, positions: torch.Tensor, seen: int,
                   layer_idx: int, check_nan: bool = True) -> torch.Tensor:
    """The scores placement ranks by once `seen` tokens are written: ``scores`` plus an `AgeAware` scorer's
    term for ages ``seen - 1 - positions`` (0 for the latest entry); ``[kv_heads, n]`` float32.

    The term is checked as `checked_scores` checks scores (`check_nan=False` leaves the NaN check to the
    caller): a NaN had ranked entries without a word."""
    if not isinstance(scorer, AgeAware):
        return scores
    ages = (seen - 1) - positions
    bias = scorer.age_bias(ages, layer_idx)
    name = scorer_name(scorer)
    if not isinstance(bias, torch.Tensor):
        raise ScorerError(f"scorer {name!r}: age_bias returned {type(bias).__name__}; expected a tensor of shape "
                          f"[kv_heads, n] = {list(scores.shape)}")
    if tuple(bias.shape) != tuple(scores.shape):
        raise ScorerError(f"scorer {name!r}: age_bias returned shape {list(bias.shape)}; expected "
                          f"[kv_heads, n] = {list(scores.shape)}")
    if not bias.is_floating_point():
        raise ScorerError(f"scorer {name!r}: age_bias returned dtype {bias.dtype}; expected a floating-point tensor")
    if check_nan and torch.isnan(bias).any():
        raise nan_error(name, layer_idx)
    return scores.float() + bias.float()


def scorer_name(scorer: object) -> str:
    """The scorer's ``name``, or its class name for a scorer without one (for messages and stats)."""
    name = getattr(scorer, "name", None)
    return name if isinstance(name, str) else type(scorer).__name__


def needs_query(scorer: object) -> bool:
    """Whether the cache must score `scorer`'s entries after attention, with the query (a `QueryScorer`).

    Reads the ``needs_query`` marker, which third-party scorers may set without naming the protocols.
    """
    marker = _marker(scorer)
    if marker is None:
        raise ScorerError(f"scorer {scorer_name(scorer)!r} has needs_query={getattr(scorer, 'needs_query')!r}; "
                          "allowed: True (scored after attention, with the query) or False / not set "
                          "(scored from key, value and position)")
    return marker


def capturable(scorer: object) -> bool:
    """Whether `scorer` may be scored inside a captured decode step (a CUDA graph replays its launches and skips
    its Python): it scores from key, value and position, reads nothing back to the host, and keeps no host state
    that a replay skipping its Python would leave wrong (a memo it checks before use is fine). Read from the
    ``capturable`` marker, which a scorer sets to True only when all of that holds; absent, it is False."""
    return getattr(scorer, "capturable", False) is True and not needs_query(scorer)


def check_scorer_model(scorer: object, num_layers: int, num_kv_heads: int, head_dim: int,
                       config: Any = None) -> None:
    """Let a `ModelBound` scorer refuse a model of another shape; every other scorer fits any model. With the
    model's `config`, a scorer that also knows the sizes it was trained for (``check_sizes``: KVP) refuses another
    model of the same shape."""
    if isinstance(scorer, ModelBound):
        scorer.check_model(num_layers, num_kv_heads, head_dim)
    check_sizes = getattr(scorer, "check_sizes", None)
    if config is not None and callable(check_sizes):
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        check_sizes(getattr(cfg, "hidden_size", None), getattr(cfg, "vocab_size", None))


def _check_query(name: str, keys: torch.Tensor, query: torch.Tensor, context_keys: torch.Tensor) -> None:
    batch, kv_heads, tokens, dim = keys.shape
    if (query.dim() != 4 or query.shape[0] != batch or query.shape[1] % kv_heads or query.shape[2] != tokens
            or query.shape[3] != dim):
        raise ScorerError(f"query shape {list(query.shape)} for scorer {name!r}; expected [{batch}, q_heads, "
                          f"{tokens}, {dim}] with q_heads a multiple of {kv_heads} (one query per new entry)")
    if (context_keys.dim() != 4 or context_keys.shape[:2] != keys.shape[:2] or context_keys.shape[2] < tokens
            or context_keys.shape[3] != dim):
        raise ScorerError(f"context_keys shape {list(context_keys.shape)} for scorer {name!r}; expected "
                          f"[{batch}, {kv_heads}, n >= {tokens}, {dim}] (the keys attention read, new ones last)")


def check_one_sequence(t: torch.Tensor, name: str) -> None:
    """Refuse a batch of several sequences where a scorer reads the first alone (the rest had been dropped)."""
    if t.shape[0] != 1:
        raise ScorerError(f"{name} scores one sequence at a time; got a batch of {t.shape[0]}; allowed: batch size 1")


def takes_softcap(scorer: object) -> bool:
    """Whether the scorer's ``score`` takes the ``softcap`` keyword (by name, or as ``**kwargs``)."""
    try:
        params = inspect.signature(scorer.score).parameters.values()
    except (TypeError, ValueError):   # a builtin without a signature: given the keywords of the contract only
        return False
    return any(p.name == "softcap" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def checked_scores(scorer: Scorer | QueryScorer, keys: torch.Tensor, values: torch.Tensor,
                   positions: torch.Tensor, layer_idx: int, *, query: torch.Tensor | None = None,
                   context_keys: torch.Tensor | None = None, scaling: float | None = None,
                   softcap: float | None = None, check_nan: bool = True) -> torch.Tensor:
    """Call `scorer` as its kind requires and verify its output, so a faulty scorer fails loudly.

    The query keywords go to a `QueryScorer` only (callers may always pass them); a `QueryScorer` without
    them is an error. Returns ``[batch, kv_heads, tokens]`` float32. `check_nan=False` leaves the NaN check
    (which reads a value back from the device) to the caller: see `nan_error`.
    """
    name = scorer_name(scorer)
    if needs_query(scorer):
        given = {"query": query, "context_keys": context_keys, "scaling": scaling}
        missing = [k for k in _QUERY_KEYWORDS if given[k] is None]
        if missing:
            raise ScorerError(f"scorer {name!r} needs the attention query: it ranks from attention weights, so "
                              f"it is scored after attention with {', '.join(k + '=' for k in _QUERY_KEYWORDS)} "
                              f"(missing: {', '.join(missing)})")
        _check_query(name, keys, query, context_keys)
        capped = {"softcap": softcap} if softcap and takes_softcap(scorer) else {}
        out = scorer.score(keys, values, positions, layer_idx, query=query, context_keys=context_keys,
                           scaling=scaling, **capped)
    else:
        out = scorer.score(keys, values, positions, layer_idx)
    expected = tuple(keys.shape[:3])
    if not isinstance(out, torch.Tensor):
        raise ScorerError(f"scorer {name!r} returned {type(out).__name__}; expected a tensor of shape "
                          f"[batch, kv_heads, tokens] = {list(expected)}")
    if tuple(out.shape) != expected:
        raise ScorerError(f"scorer {name!r} returned shape {list(out.shape)}; expected "
                          f"[batch, kv_heads, tokens] = {list(expected)}")
    if not out.is_floating_point():
        raise ScorerError(f"scorer {name!r} returned dtype {out.dtype}; expected a floating-point tensor")
    if out.device != keys.device:
        raise ScorerError(f"scorer {name!r} returned scores on {out.device}; expected them on the keys' device, "
                          f"{keys.device}")
    out = out.float()
    if check_nan and torch.isnan(out).any():
        raise nan_error(name, layer_idx)
    return out


def nan_error(name: str, layer_idx: int) -> ScorerError:
    """The error for NaN scores (raised at once, or where the check is deferred, once the next demotion's
    copies to the host have landed)."""
    return ScorerError(f"scorer {name!r} returned NaN scores at layer {layer_idx}; scores must be "
                       "ordered numbers (+inf/-inf are allowed)")
