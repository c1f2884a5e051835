"""The attention function that lets a `TieredCache` see the query: recall, then exact attention.

transformers calls the cache's ``update`` and then the attention function of the model's config, and
never hands the cache to that function. ``update`` therefore leaves a claim: "this key tensor is mine".
The function below looks the key up; a claimed key gets recall and the split attention, any other key
(another cache, no cache) goes straight to the attention implementation it wraps, with the same
arguments, so other caches see no change at all.

The function is registered with transformers by `use_tiered_attention(config)` (called by `TieredCache`)
under ``"kvtier_<base>"``, together with the base's mask function, and `restore_attention(config)` undoes it.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from typing import Any, Callable

import torch

from ..errors import ConfigError, UnsupportedError
from .mask_reads import MaskVerdicts

PREFIX = "kvtier_"
# implementations kvtier works with (the names transformers gives them); a kernel-hub name is passed through
KNOWN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")
REFUSED_IMPLEMENTATIONS = {
    "paged": "paged attention reads transformers' continuous-batching cache, not the cache it is given",
    "flex_attention": "its block masks do not say which tokens are padding, so padding could come back with "
                      "recalled pages",
}
_claims = threading.local()


def claim(key: torch.Tensor, value: torch.Tensor, engine: Any) -> None:
    """Mark `key` (as returned by ``update``, with `value`) as belonging to `engine` until attention runs."""
    _table()[id(engine)] = (weakref.ref(key), weakref.ref(engine), weakref.ref(value))


def _table() -> dict:
    if not hasattr(_claims, "table"):
        _claims.table = {}
    return _claims.table


def _take_claim(key: torch.Tensor) -> tuple[Any, torch.Tensor | None] | None:
    """The layer `key` was claimed by, and the values it returned with it (None: not claimed)."""
    table = _table()
    for owner, (key_ref, engine_ref, value_ref) in list(table.items()):
        if key_ref() is key:
            del table[owner]
            return engine_ref(), value_ref()
        if key_ref() is None or engine_ref() is None:
            del table[owner]
    return None


def _base_function(name: str, module: torch.nn.Module) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise ConfigError(f"cannot find the attention implementation {name!r} for {type(module).__name__}")
    return eager


class _Overlay:
    """`base` seen with some attributes replaced (`overrides`), every other one read from it: how a layer's module
    and config look to the model's own attention, with nothing shared changed (for every layer and thread)."""

    def __init__(self, base: Any, **overrides: Any) -> None:
        self.__dict__.update(overrides, _base=base)

    def __getattr__(self, attr: str) -> Any:   # only for what `overrides` does not name
        return getattr(self._base, attr)


def _reads_its_name(base: str) -> bool:
    """Whether transformers' implementation `base` reads its name from the module's config: flash attention (it
    loads its kernels by that name, and knows no ``kvtier_`` one), from the flash packages or a kernel hub."""
    return base.startswith("flash_attention") or "/" in base


def _call_base(base: str, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The model's own attention `base`, seeing its own name in ``module.config._attn_implementation``."""
    fn = _base_function(base, module)
    if _reads_its_name(base) and hasattr(module, "config"):
        named = _Overlay(module, config=_Overlay(module.config, _attn_implementation=base))
        return fn(named, *args, **kwargs)
    return fn(module, *args, **kwargs)


# keywords an attention function may get that change what it computes beyond the query and the keys; the split
# attention over recalled pages cannot apply them, so a layer that recalls refuses them
UNSUPPORTED_KWARGS = {
    "position_bias": "an additive position bias",
    "cu_seq_lens_q": "packed sequences",
    "cu_seq_lens_k": "packed sequences",
    "sliding_window": "a sliding window on a full-attention layer",
}
_warned: set[str] = set()


def _make_attention(base: str) -> Callable:
    def kvtier_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        claimed = _take_claim(key)
        if claimed is None or claimed[0] is None:
            return _call_base(base, module, query, key, value, attention_mask, **kwargs)
        layer, values = claimed
        try:
            asked = bool(kwargs.get("output_attentions"))
            refuse = [UNSUPPORTED_KWARGS[k] for k in UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
            if value is not values:   # DiffLlama attends over halves of the values, twice
                refuse.append("values other than those the cache returned (the model changed them after update)")
            result = layer.attend(query, attention_mask, scaling=kwargs.get("scaling"),
                                  softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"),
                                  weights=asked and base == "eager", refuse=refuse)
            if result is None:
                return _call_base(base, module, query, key, value, attention_mask, **kwargs)
            if asked and base != "eager" and base not in _warned:
                _warned.add(base)   # what the base implementation itself does: no weights, one warning
                warnings.warn(f"output_attentions=True with attn_implementation={base!r} returns no attention "
                              "weights; use attn_implementation='eager' to get them", stacklevel=2)
            return result
        finally:
            layer.commit(query, kwargs.get("scaling"), kwargs.get("softcap"))

    kvtier_attention.__name__ = f"{PREFIX}{base}"
    return kvtier_attention


_ALL_SEEN = MaskVerdicts()   # whether some row of a mask allows every column


def _seen_by_any(mask: torch.Tensor) -> torch.Tensor:
    """``[columns]`` bool: whether some row of the (first) mask allows each column."""
    if mask.dim() == 2:   # 1 keeps a token, 0 is padding
        return mask[0].bool()
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    return allowed[0].any(dim=0).any(dim=0)


def masked_new_tokens(attention_mask: torch.Tensor | None, stored: int, q_len: int) -> torch.Tensor | None:
    """Which of a step's `q_len` new tokens no query may attend (padding), from the mask transformers built:
    ``[q_len]`` bool, or None when nothing is masked out beyond causality.

    A column is padding when no row of the mask allows it (the last row of a causal mask allows every column,
    so causality alone never marks one). Columns are the entries `update` returned: `stored` device entries,
    then the new tokens. Flash attention gets the 2D padding mask ``[batch, columns]`` instead of a 4D one.
    """
    if attention_mask is None or attention_mask.dim() not in (2, 4):
        return None
    if _ALL_SEEN.verdict(attention_mask, lambda m: _seen_by_any(m).all()):   # read once a mask, not a layer
        return None
    seen_by_any = _seen_by_any(attention_mask)
    if seen_by_any.shape[0] != stored + q_len:
        raise ConfigError(f"an attention mask of {seen_by_any.shape[0]} columns with masked-out entries, for "
                          f"{stored} stored entries and {q_len} new tokens; allowed: a mask that matches "
                          "the cache's mask sizes")
    hidden = ~seen_by_any[:stored]
    if hidden.any():
        # left padding left the cache when it was written (its columns are past the mask's offset): a stored
        # column hidden now is another token, which the split attention cannot hide, and the model's own
        # attention would hide whichever entry stands in that column
        raise UnsupportedError(f"the attention mask hides {int(hidden.sum())} of the {stored} stored entries from "
                               "every query; allowed: masks that hide only padding on the left of the prompt, "
                               "when it is written")
    masked = ~seen_by_any[stored:]
    return masked if masked.any() else None


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def use_tiered_attention(config: Any) -> str:
    """Route `config`'s attention through kvtier (idempotent); returns the implementation name set."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    text = _text_config(config)
    current = getattr(text, "_attn_implementation", None) or "eager"
    if not isinstance(current, str):
        raise ConfigError(f"attn_implementation={current!r} is not supported; allowed: one implementation "
                          "name for the text model (e.g. 'sdpa' or 'eager')")
    if current.startswith(PREFIX):
        return current
    for name, why in REFUSED_IMPLEMENTATIONS.items():
        if name in current:
            raise UnsupportedError(f"attn_implementation={current!r} is not supported by TieredCache: {why}; "
                                   f"allowed: {', '.join(map(repr, KNOWN_IMPLEMENTATIONS))}")
    name = f"{PREFIX}{current}"
    AttentionInterface.register(name, _make_attention(current))
    if current in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    text._attn_implementation = name
    return name


def attention_routed(config: Any) -> bool:
    """Whether `config`'s attention runs through kvtier (`use_tiered_attention`, not undone since)."""
    current = getattr(_text_config(config), "_attn_implementation", None)
    return isinstance(current, str) and current.startswith(PREFIX)


def restore_attention(config: Any) -> None:
    """Put back the attention implementation `use_tiered_attention` replaced."""
    text = _text_config(config)
    current = getattr(text, "_attn_implementation", None)
    if isinstance(current, str) and current.startswith(PREFIX):
        text._attn_implementation = current[len(PREFIX):]
