"""The model the decode rows run through: Llama-3.1-8B's shape (or a tiny one for tests) with random bf16
weights made on the device, and a KVP scorer of the same shape (weights do not change speed).
"""

from __future__ import annotations

import inspect
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

DTYPE = torch.bfloat16

# The 8B shape of the issue (Llama-3.1-8B) and a tiny one for tests; weights are random.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "intermediate_size": 14336, "vocab_size": 128256, "num_hidden_layers": 32},
    "tiny": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
             "intermediate_size": 512, "vocab_size": 1024, "num_hidden_layers": 4},
}
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def kv_bytes_per_token(shape: dict[str, Any], layers: int) -> int:
    """K+V bytes of one token over `layers` layers in bf16."""
    return layers * shape["num_key_value_heads"] * shape["head_dim"] * 2 * 2


def llama_config(shape: str, layers: int) -> Any:
    """A `LlamaConfig` of the preset's shape with `layers` layers (llama3 RoPE, theta 500000)."""
    from transformers import LlamaConfig

    s = dict(SHAPES[shape], num_hidden_layers=layers, max_position_embeddings=131072, rms_norm_eps=1e-5,
             tie_word_embeddings=False)
    params = inspect.signature(LlamaConfig.__init__).parameters
    if "rope_parameters" in params:          # transformers 5.x
        return LlamaConfig(**s, rope_parameters=dict(ROPE))
    rope = {k: v for k, v in ROPE.items() if k != "rope_theta"}
    return LlamaConfig(**s, rope_theta=ROPE["rope_theta"], rope_scaling=rope)


def build_model(shape: str, layers: int, device: torch.device, seed: int) -> tuple[Any, float]:
    """A `LlamaForCausalLM` with random bf16 weights made directly on `device` (no fp32 copy, no host
    round trip: the parameters are created on the device and initialised there); returns it and the seconds."""
    from transformers import AutoModelForCausalLM

    config = llama_config(shape, layers)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPE, attn_implementation="sdpa")
    model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return model, time.perf_counter() - t0


def kvp_for(config: Any, num_layers: int, kv_heads: int, head_dim: int, seed: int) -> tuple[Any, str]:
    """The KVP scorer for this shape: the shipped weights when they fit it, else an untrained KVP of the same
    architecture (random weights: the same work per entry, so the same time)."""
    from ...scoring.kvp import KVPAgents, KVPScorer, save_agents, shipped_for

    model = shipped_for(config, head_dim)
    if model:
        return KVPScorer(model=model), f"kvp (shipped weights for {model})"
    torch.manual_seed(seed)
    agents = KVPAgents(num_layers * kv_heads, head_dim)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as folder:
        path = Path(folder) / "untrained.safetensors"
        save_agents(agents, path, {"model": "untrained (kvtier bench gpu)", "num_layers": num_layers,
                                   "num_kv_heads": kv_heads})
        scorer = KVPScorer(path=str(path))
    return scorer, "kvp (untrained, same architecture: no weights ship for this shape)"
