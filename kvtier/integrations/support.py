"""What kvtier does with a given model: which layers it tiers, which it keeps as transformers does, which
attention variants its split attention applies, and the limits that hold. `kvtier info --model` prints it;
docs/usage.md has the table for the architectures the tests cover.
"""

from __future__ import annotations

from typing import Any

from ..config import ModelShape
from ..errors import ConfigError, UnsupportedError
from .attention import REFUSED_IMPLEMENTATIONS
from .layers import TIERED, layer_plan

LIMITS = ("batch size 1 (no beam search, num_return_sequences > 1 or batched prompts)",
          "no assisted or speculative decoding (crop)",
          "padding (an attention mask with masked-out tokens) in the first step only")


def _text(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def attention_notes(text: Any) -> list[str]:
    """The ways the model's attention differs from plain softmax attention, and what kvtier does about each."""
    notes = []
    cap = getattr(text, "attn_logit_softcapping", None)
    if cap is not None:
        notes.append(f"logit soft-capping at {cap}: applied to recalled and device entries alike")
    if getattr(text, "model_type", None) == "gpt_oss":
        notes.append("learned attention sinks (one logit per query head): a softmax term in the split attention")
    if getattr(text, "query_pre_attn_scalar", None) is not None:
        notes.append(f"logit scale 1/sqrt({text.query_pre_attn_scalar}): taken from the model's attention")
    if getattr(text, "attention_multiplier", None) is not None:
        notes.append(f"logit scale {text.attention_multiplier}: taken from the model's attention")
    if getattr(text, "partial_rotary_factor", 1.0) not in (None, 1.0):
        notes.append(f"partial rotary ({text.partial_rotary_factor}): applied before the cache, nothing to do")
    if getattr(text, "use_qk_norm", False) or getattr(text, "model_type", "") in ("qwen3", "qwen3_moe", "olmo2",
                                                                                 "gemma3_text", "olmo3"):
        notes.append("QK-norm: applied before the cache, nothing to do")
    return notes


def support(config: Any) -> dict:
    """Whether kvtier can hold this model's cache, and how: a dict for `kvtier info --model` and tests."""
    text = _text(config)
    arch = getattr(text, "model_type", None) or type(text).__name__
    try:
        plan = layer_plan(config)
        shape = ModelShape.from_config(config)
    except (UnsupportedError, ConfigError) as e:
        return {"architecture": arch, "supported": False, "reason": str(e)}
    groups = plan.describe()
    tiered = len(plan.tiered)
    impl = getattr(text, "_attn_implementation", None)
    limits = list(LIMITS)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if arch == "phi3" and isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "longrope":
        limits.insert(0, f"long rope: once a sequence passes original_max_position_embeddings="
                         f"{getattr(text, 'original_max_position_embeddings', '?')}, transformers' generate drops the "
                         "cache it was given and recomputes into a DynamicCache, so the TieredCache goes unused "
                         "from there")
    if not tiered:
        limits.insert(0, "every layer is a sliding-window layer: nothing is tiered (kvtier adds nothing here)")
    for name, why in REFUSED_IMPLEMENTATIONS.items():
        if isinstance(impl, str) and name in impl:
            limits.insert(0, f"attn_implementation={impl!r} is refused: {why}")
    return {
        "architecture": arch,
        "supported": True,
        "layers": len(plan.kinds),
        "tiered_layers": tiered,
        "kept_layers": [{"kind": g["kind"], "window": g["window"], "count": len(g["layers"])}
                        for g in groups if g["kind"] != TIERED],
        "kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "attention": attention_notes(text),
        "limits": limits,
    }


def describe_support(info: dict) -> list[str]:
    """`support` as lines of text."""
    if not info["supported"]:
        return [f"model: {info['architecture']}: not supported: {info['reason']}"]
    lines = [f"model: {info['architecture']}: {info['tiered_layers']} of {info['layers']} layers tiered "
             f"(full attention; {info['kv_heads']} KV heads x {info['head_dim']})"]
    for kept in info["kept_layers"]:
        window = f", window {kept['window']}" if kept["window"] else ""
        lines.append(f"  kept as transformers keeps them: {kept['count']} {kept['kind']} layers{window}, on the "
                     "device")
    for note in info["attention"]:
        lines.append(f"  attention: {note}")
    for limit in info["limits"]:
        lines.append(f"  limit: {limit}")
    return lines
