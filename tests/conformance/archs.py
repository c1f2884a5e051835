"""The architectures the conformance tests run: one line per architecture.

Each row names a transformers config class and the settings that make it tiny (on top of `BASE`), and says
what kvtier is expected to do with it: ``"supported"`` (matches `DynamicCache`) or ``"refused: <text>"``
(`UnsupportedError` whose message contains ``<text>``). Models are random-weight, seeded and in eval mode.

To add an architecture, add one `Arch(...)` line to `ARCHS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import transformers

SEED = 0
WINDOW = 64          # sliding windows: the 300-token prompts are far longer
PROMPT = 300
VOCAB = 256
DROP = object()      # an override that removes a `BASE` key (a config without that setting)

BASE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1,
    eos_token_id=None,   # never stop early: every run returns exactly the tokens asked for
)
SW = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])   # both kinds of layer


def _strong_sinks(model: torch.nn.Module) -> None:
    """GPT-OSS initialises its sink logits near 0, where a sink takes ~1/300 of the attention; make them
    large (e^7 against ~300 keys: most of the mass) so that an attention which forgets them is visibly wrong,
    in bfloat16 too."""
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for layer in model.model.layers:
            sinks = layer.self_attn.sinks
            sinks.copy_((7.0 + torch.randn(sinks.shape, generator=g)).to(sinks.dtype))


@dataclass(frozen=True)
class Arch:
    name: str
    config_class: str                      # a class in `transformers`
    overrides: dict[str, Any] = field(default_factory=dict)
    expect: str = "supported"              # or "refused: <text the UnsupportedError names>"
    tweak: Callable[[torch.nn.Module], None] | None = None   # applied to the built model's weights
    note: str = ""
    # the attention implementations transformers runs the model under; a declared one that this transformers
    # version cannot run (the model class's `_supports_sdpa`) is skipped with the reason, see `sdpa_unsupported`
    attn: tuple[str, ...] = ("eager", "sdpa")

    @property
    def supported(self) -> bool:
        return self.expect == "supported"

    @property
    def refusal(self) -> str:
        assert self.expect.startswith("refused: "), self.expect
        return self.expect[len("refused: "):]

    def __str__(self) -> str:
        return self.name


# settings shared by several rows (a row stays one line)
LLAMA3_ROPE = dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=128))
LONGROPE = dict(max_position_embeddings=131072, original_max_position_embeddings=4096,
                rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                     short_factor=[1.0 + i / 8 for i in range(8)], long_factor=[2.0 + i for i in range(8)]))
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
QWEN3_NEXT = dict(MOE, layer_types=["linear_attention", "full_attention"], shared_expert_intermediate_size=32,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
MLA = dict(head_dim=DROP, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
           qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
           first_k_dense_replace=1, moe_intermediate_size=32)
LONGROPE_NOTE = "prompts stay below original_max_position_embeddings: past it Phi-3's generate drops the cache it was given"

ARCHS: list[Arch] = [
    Arch("llama", "LlamaConfig"),
    Arch("llama-rope-scaling", "LlamaConfig", LLAMA3_ROPE),
    Arch("qwen2", "Qwen2Config"),
    Arch("qwen2-sliding", "Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), note="layer_types derived: [full, sliding]"),
    Arch("qwen3", "Qwen3Config"),
    Arch("qwen3-moe", "Qwen3MoeConfig", MOE),
    Arch("mistral", "MistralConfig", dict(sliding_window=None), note="MistralConfig's default sliding_window is 4096"),
    Arch("mistral-sliding", "MistralConfig", dict(sliding_window=WINDOW), note="model-wide window, no layer_types"),
    Arch("phi3", "Phi3Config"),
    Arch("phi3-longrope", "Phi3Config", LONGROPE, note=LONGROPE_NOTE),
    Arch("olmo2", "Olmo2Config"),
    Arch("olmo3", "Olmo3Config", SW),
    Arch("granite", "GraniteConfig"),
    Arch("gpt-neox", "GPTNeoXConfig", dict(num_key_value_heads=DROP), note="multi-head (no GQA), partial rotary"),
    Arch("stablelm", "StableLmConfig"),
    Arch("smollm3", "SmolLM3Config", dict(no_rope_layers=[1, 0]), note="layer 2 is NoPE"),
    Arch("gemma2", "Gemma2Config", dict(SW, initializer_range=0.1, query_pre_attn_scalar=1, attn_logit_softcapping=1.0), note="scores of several units capped at 1"),
    Arch("gemma3", "Gemma3TextConfig", SW),
    Arch("cohere2", "Cohere2Config", SW),
    Arch("gpt-oss", "GptOssConfig", dict(SW, num_local_experts=4, num_experts_per_tok=2), tweak=_strong_sinks, attn=("eager",), note="sinks; no sdpa in transformers"),
    Arch("llama4", "Llama4TextConfig", dict(attention_chunk_size=WINDOW, no_rope_layers=[1, 0], num_local_experts=2, num_experts_per_tok=1, intermediate_size_mlp=128)),
    Arch("qwen3-next", "Qwen3NextConfig", QWEN3_NEXT, expect="refused: linear_attention"),
    Arch("lfm2", "Lfm2Config", dict(layer_types=["conv", "full_attention"]), expect="refused: conv"),
    Arch("deepseek-v3", "DeepseekV3Config", MLA, expect="refused: multi-head latent attention"),
]
BY_NAME = {a.name: a for a in ARCHS}
assert len(BY_NAME) == len(ARCHS), "architecture names must be unique"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ATTNS = ("eager", "sdpa")


def config_class(arch: Arch) -> type | None:
    """The config class, or None where this transformers version lacks it."""
    return getattr(transformers, arch.config_class, None)


def make_config(arch: Arch) -> Any:
    """A tiny config of `arch`."""
    cls = config_class(arch)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {arch.config_class}")
    kwargs = {**BASE, **arch.overrides}
    return cls(**{k: v for k, v in kwargs.items() if v is not DROP})


def layer_kinds(config: Any) -> list[str]:
    """The attention kind of each layer, the way transformers' caches read it: ``layer_types`` when the
    config has it, else ``sliding_attention`` for every layer of a model-wide ``sliding_window``."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    if getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * config.num_hidden_layers
    if getattr(config, "attention_chunk_size", None) is not None:
        return ["chunked_attention"] * config.num_hidden_layers
    return ["full_attention"] * config.num_hidden_layers


def sdpa_unsupported(arch: Arch) -> str | None:
    """Why `arch` cannot be compared under sdpa in this transformers version, or None when it can."""
    cfg = make_config(arch)
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(cfg)]
    if not getattr(model_class, "_supports_sdpa", False):
        return (f"{model_class.__name__}._supports_sdpa is False in transformers {transformers.__version__} "
                "(building it with attn_implementation='sdpa' raises)")
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        # transformers 5.17 lets Gemma 2 run under sdpa and silently drops the soft-cap: no reference to match
        return (f"transformers {transformers.__version__}'s sdpa ignores attn_logit_softcapping, so "
                "DynamicCache under sdpa is not the model")
    return None


_MODELS: dict[tuple[str, str, str], torch.nn.Module] = {}


def model(name: str, dtype: str = "float32", attn: str = "eager") -> torch.nn.Module:
    """The tiny model of architecture `name` (seeded random weights, eval mode), built once per session.

    Skips (pytest) where this transformers version lacks the config class or cannot run it under `attn`.
    """
    key = (name, dtype, attn)
    if key not in _MODELS:
        arch = BY_NAME[name]
        if attn not in arch.attn:
            pytest.skip(f"{name} declares attention implementations {arch.attn} ({arch.note})")
        if attn == "sdpa":
            reason = sdpa_unsupported(arch)
            if reason is not None:
                pytest.skip(reason)
        cfg = make_config(arch)
        torch.manual_seed(SEED)
        built = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=DTYPES[dtype])
        if arch.tweak is not None:
            arch.tweak(built)
        _MODELS[key] = built.eval()
    return _MODELS[key]


def built_models() -> list[torch.nn.Module]:
    """Every model built so far."""
    return list(_MODELS.values())


def prompt(length: int = PROMPT, seed: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    """``[1, length]`` random token ids, never the pad (0) or bos (1) ids."""
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))
