"""What users run, on a GPU: `kvtier demo --synthetic` with its device tier on the GPU, and the evaluation
harness's own functions (a shared prefill, teacher-forced loss, greedy answers) with a model on the GPU fed the
CPU tensors that tokenizers and tasks make."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from transformers import LlamaConfig, LlamaForCausalLM

from kvtier.bench.synthetic import synthetic_needles
from kvtier.cli import main
from kvtier.eval.policies import Policy
from kvtier.eval.runner import _greedy, continuation_nll
from kvtier.eval.shared_prefill import PromptScores, full_copy, load_prefill, shared_prefill
from kvtier.integrations.hf import TieredCache
from kvtier.scoring import make_scorer

pytestmark = pytest.mark.cuda


def test_the_synthetic_demo_recalls_every_needle_on_the_gpu_as_on_the_cpu(cuda_device):
    result = CliRunner().invoke(main, ["demo", "--synthetic", "--context", "64K", "--needles", "3", "--device",
                                       "cuda", "--json"])
    assert result.exit_code == 0, result.output
    gpu = json.loads(result.stdout)
    assert gpu["settings"]["device"] == str(cuda_device)
    cpu = synthetic_needles("llama-3.1-8b", 65536, 3, 0.01, 0.05, 32, device="cpu")
    assert [n["position"] for n in gpu["needles"]] == [n["position"] for n in cpu["needles"]]
    for n in gpu["needles"]:
        assert n["recalled"] and n["cosine_to_needle_value"] > 0.999, n
        assert n["max_abs_error_vs_full"] < 0.05, n    # bfloat16 output against a float32 reference
    assert {t: gpu["usage"][t]["tokens"] for t in ("device", "host", "disk")} == \
        {t: cpu["usage"][t]["tokens"] for t in ("device", "host", "disk")}


@pytest.fixture(scope="module")
def gpu_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=256, vocab_size=256, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(torch.device("cuda", torch.cuda.current_device())).eval()


def test_the_eval_harness_runs_a_gpu_model_on_cpu_inputs_and_every_page_recalled_is_the_full_cache(gpu_llama):
    """As `kvtier eval` runs it: the prompt and continuation come from the tasks on the CPU; tier mode with every
    page recalled gives the full cache's loss and greedy tokens (float32)."""
    g = torch.Generator().manual_seed(1)
    prompt, continuation = torch.randint(0, 256, (1, 300), generator=g), torch.randint(0, 256, (1, 40), generator=g)
    pre = shared_prefill(gpu_llama, prompt)
    assert pre.last_logits.is_cuda
    full = continuation_nll(gpu_llama, full_copy(pre), pre.last_logits, continuation)
    with torch.no_grad():
        logits = gpu_llama(torch.cat([prompt, continuation[:, :-1]], 1).cuda()).logits[0, prompt.shape[1] - 1:]
    assert full == pytest.approx(float(F.cross_entropy(logits.float(), continuation[0].cuda())), rel=1e-4)
    settings = Policy.parse("tier-all:keynorm").cache_settings(0.1)
    settings["scorer"] = PromptScores(make_scorer("keynorm"), prompt.shape[1])
    for run in ("loss", "greedy"):
        cache = TieredCache(gpu_llama.config, **settings)
        try:
            load_prefill(pre, cache)
            if run == "loss":
                assert continuation_nll(gpu_llama, cache, pre.last_logits, continuation) == pytest.approx(full,
                                                                                                          rel=1e-3)
            else:
                assert cache.stats()["device"]["tokens"] < 300 * 2 * 2   # pages were demoted and come back
                assert _greedy(gpu_llama, cache, pre.last_logits, 12, set()) == \
                    _greedy(gpu_llama, full_copy(pre), pre.last_logits, 12, set())
        finally:
            cache.close()
