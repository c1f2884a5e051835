"""Which of a model's layers kvtier tiers, and what the others keep.

A model's cache layers come in kinds (transformers' ``layer_types``): full-attention layers grow with the
context and are tiered; sliding-window and chunked layers hold a bounded window, so they keep transformers'
own layer, on the device, with nothing to tier. The kinds are read with transformers' own function, so a
TieredCache has exactly the layers a ``DynamicCache(config=...)`` would have, with the full-attention ones
replaced. A model-wide ``sliding_window`` without ``layer_types`` (Mistral's configs) makes every layer a
sliding one, as in transformers. Kinds kvtier cannot hold (recurrent states, latent caches) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from ..engine.parking import ParkedFile
from ..errors import UnsupportedError

TIERED = "full_attention"
WINDOWED = ("sliding_attention", "chunked_attention")
NO_CACHE = ("dummy",)   # layers that hold nothing (shared-KV consumers, attention-free blocks)
_WHY = {
    "linear_attention": "a recurrent (linear-attention/state-space) layer keeps a state, not per-token K/V",
    "conv": "a convolution layer keeps a state, not per-token K/V",
    "hybrid": "a layer mixing a recurrent state with attention",
    "hybrid_sliding": "a layer mixing a recurrent state with windowed attention",
    "indexed_attention": "a sparse-attention layer with its own key index",
    "deepseek_sparse_attention": "a sparse-attention layer with its own key index",
    "qwen_sparse_attention": "a sparse-attention layer with its own key index",
    "heavily_compressed_attention": "a layer caching compressed keys",
    "compressed_sparse_attention": "a layer caching compressed keys",
}


@dataclass(frozen=True)
class LayerPlan:
    """The kind of each cache layer and the settings transformers gives it (``sliding_window``)."""

    kinds: tuple[str, ...]
    settings: tuple[dict, ...]

    @property
    def tiered(self) -> list[int]:
        """Indices of the layers kvtier tiers."""
        return [i for i, kind in enumerate(self.kinds) if kind == TIERED]

    def describe(self) -> list[dict]:
        """Groups of consecutive settings: what each kind holds, for `kvtier info --model` and the docs."""
        rows: dict[tuple, dict] = {}
        for i, (kind, kw) in enumerate(zip(self.kinds, self.settings)):
            key = (kind, kw.get("sliding_window"))
            row = rows.setdefault(key, {"kind": kind, "window": kw.get("sliding_window"), "layers": [],
                                        "tiered": kind == TIERED})
            row["layers"].append(i)
        return list(rows.values())


def _text_config(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def layer_plan(config: Any) -> LayerPlan:
    """The cache layers a model needs, as transformers builds them; refuses kinds kvtier cannot hold."""
    from transformers import PreTrainedConfig
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = _text_config(config)
    check_per_head_kv(text)
    check_attention_name_unread(text)
    if isinstance(text, PreTrainedConfig):
        kinds, settings = get_layer_types_and_kwargs(text)
    else:   # a plain object with the config's fields: transformers' rule, read directly
        window = getattr(text, "sliding_window", None)
        kinds = getattr(text, "layer_types", None) or \
            ["sliding_attention" if window is not None else "full_attention"] * int(text.num_hidden_layers)
        settings = {"sliding_window": window} if window is not None else {}
    kinds = list(kinds)
    if isinstance(settings, dict):   # transformers before 5.24: one set of settings for every layer
        settings = [dict(settings) if kind in WINDOWED else {} for kind in kinds]
    unknown = sorted({k for k in kinds if k != TIERED and k not in WINDOWED and k not in NO_CACHE})
    if unknown:
        why = "; ".join(f"{k!r}: {_WHY.get(k, 'a layer kind kvtier does not know')}" for k in unknown)
        raise UnsupportedError(f"{type(text).__name__} has layer types {unknown} that kvtier cannot hold ({why}); "
                               f"allowed: {TIERED!r} layers (tiered) with {' or '.join(map(repr, WINDOWED))} "
                               "layers (kept as transformers keeps them)")
    return LayerPlan(tuple(kinds), tuple(dict(s) for s in settings))


def check_attention_name_unread(text: Any) -> None:
    """Refuse a model whose own code picks a path by its attention's name: kvtier routes the attention under a
    name of its own, and the path would change for every cache of the model, DynamicCache included."""
    impl = getattr(text, "_attn_implementation", None)
    if getattr(text, "reorder_and_upcast_attn", False) is True and impl in ("eager", "kvtier_eager"):
        raise UnsupportedError(f"{type(text).__name__} has reorder_and_upcast_attn=True with eager attention: the "
                               "model takes its upcast path only where the attention is named 'eager', and kvtier "
                               "routes it under a name of its own; allowed: reorder_and_upcast_attn=False, or "
                               "attn_implementation='sdpa'")


def check_per_head_kv(text: Any) -> None:
    """Refuse models whose cache is not per-head keys and values of one head size (DeepSeek's MLA), whose
    attention is set layer by layer (Gemma 4), or whose layers reuse another layer's keys and values (Gemma 3n)."""
    name = type(text).__name__
    for attr in ("head_dim", "num_key_value_heads", "num_attention_heads"):
        try:
            getattr(text, attr, None)
        except Exception as e:   # transformers' AmbiguousGlobalPerLayerAttributeError, where the layers differ
            if type(e).__name__ != "AmbiguousGlobalPerLayerAttributeError":
                raise
            raise UnsupportedError(f"{name} sets {attr} layer by layer (per_layer_config), and its layers differ; "
                                   "kvtier holds layers of one head size and one count of KV heads; allowed: "
                                   "models whose layers share them") from e
    shared = getattr(text, "num_kv_shared_layers", None) or 0
    if shared:
        raise UnsupportedError(
            f"{name} has num_kv_shared_layers={shared}: its last {shared} layers attend with the keys and values an "
            "earlier layer cached, which kvtier hands that layer's own attention only (its device part, the rest "
            "recalled for its own query), so the layers that reuse them would miss the demoted entries; allowed: "
            "models whose every attention layer caches its own keys and values (num_kv_shared_layers=0)")
    if getattr(text, "kv_lora_rank", None) is not None:
        raise UnsupportedError(
            f"{name} uses multi-head latent attention (kv_lora_rank={text.kv_lora_rank}): its keys and values are "
            "projected from a shared latent with different key and value head sizes, not per-head K/V of one "
            "size, which is what kvtier pages, scores and recalls; allowed: models with per-head keys and values")
    v_dim, qk_dim = getattr(text, "v_head_dim", None), getattr(text, "qk_head_dim", None)
    if qk_dim is None:   # MiMo-V2-Flash names its key heads' size head_dim (DeepSeek, qk_head_dim)
        qk_dim = getattr(text, "head_dim", None)
    if v_dim is not None and qk_dim is not None and v_dim != qk_dim:
        raise UnsupportedError(f"{name} has key heads of {qk_dim} and value heads of {v_dim}; allowed: keys "
                               "and values of one head size")


class WindowLayer(DynamicSlidingWindowLayer):
    """transformers' sliding-window layer, which a parked cache moves to host memory or to disk.

    The window stays as transformers keeps it (the last ``sliding_window - 1`` entries); parking moves it off
    the device, to host memory or to a checksummed file in the cache's private folder (`ParkedFile`), and its next
    `update` brings it back as it was. `reset` forgets it for real (transformers' own reset zeroes the tensors in
    place and keeps their length, which suits static caches only).
    """

    def __init__(self, sliding_window: int, **kwargs: Any) -> None:
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.home: torch.device | None = None   # where a parked window goes back to
        self.stored: ParkedFile | None = None   # the window's file while it is parked on disk
        self._stored_shape: tuple[int, ...] | None = None
        self._unparked: tuple | None = None     # its state before a park not yet settled (`settle_park`)

    @property
    def where(self) -> str | None:
        """Where the parked window is (``"host"``, ``"disk"``), or None while it is in use."""
        if self.stored is not None:
            return "disk"
        return None if self.home is None else "host"

    @property
    def parked(self) -> bool:
        return self.where is not None

    def park(self, to: str = "host", path: str | None = None) -> None:
        """Move the window to host memory, or (``to="disk"``) into a new file at `path`; a failure leaves it as it
        was. A window on disk stays there when parked on the host; one already in host memory (a CPU's) is not
        copied. What it held before is kept until `settle_park` (the park stands) or `undo_park` (it does not):
        undoing then reads nothing and cannot fail."""
        if not self.is_initialized or self.stored is not None:
            return
        if to != "disk" and (self.home is not None or self.keys.device.type == "cpu"):
            return
        self._unparked = (self.keys, self.values, self.home)   # first: an interruption below is undone likewise
        if to == "disk":
            stored = ParkedFile.write(path, {"keys": self.keys, "values": self.values}, "the parked window file")
            if self.home is None:   # else it is in host memory, parked there before, and goes back to its device
                self.home = self.keys.device
            self.stored, self._stored_shape = stored, tuple(self.keys.shape)
            self.keys = self.values = None
        else:
            keys, values = self.keys.to("cpu"), self.values.to("cpu")
            self.home, self.keys, self.values = self.keys.device, keys, values

    def settle_park(self) -> None:
        """The park stands: what the window held before it goes."""
        self._unparked = None

    def undo_park(self) -> None:
        """Back to the state before the park not yet settled (its file, if any, removed)."""
        if self._unparked is None:
            return
        stored, self.stored, self._stored_shape = self.stored, None, None
        (self.keys, self.values, self.home), self._unparked = self._unparked, None
        if stored is not None:
            stored.discard()

    def restore(self, got: dict[str, torch.Tensor] | None = None) -> None:
        """Bring the window back where it was (`got`: its file's tensors, read ahead; else the file is read now).
        A failure (a missing or changed file, no memory) leaves it parked as it was."""
        if self.stored is not None:
            if got is None:
                got = self.stored.read()
            keys, values = got["keys"].to(self.home), got["values"].to(self.home)
            stored, self.stored, self._stored_shape = self.stored, None, None
            self.keys, self.values, self.home = keys, values, None
            stored.discard()
        elif self.home is not None:
            self.keys, self.values = self.keys.to(self.home), self.values.to(self.home)
            self.home = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.restore()
        return super().update(key_states, value_states, *args, **kwargs)

    def reset(self) -> None:
        if self.stored is not None:
            self.stored.discard()
        self.keys = self.values = None
        self.is_initialized = False
        self.cumulative_length = 0
        self.home = self.stored = self._stored_shape = self._unparked = None

    def tokens(self) -> int:
        """Entries held, summed over the KV heads (wherever they are)."""
        if not self.is_initialized:
            return 0
        shape = self._stored_shape if self.stored is not None else self.keys.shape
        return shape[1] * shape[2]

    def nbytes(self) -> int:
        """Memory the window holds (device or host; none while on disk)."""
        if not self.is_initialized or self.stored is not None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))

    def disk_bytes(self) -> int:
        return 0 if self.stored is None else self.stored.nbytes
