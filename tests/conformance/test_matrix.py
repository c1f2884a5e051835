"""The conformance matrix: every architecture of `archs.ARCHS` x dtype x attention implementation.

Supported rows, under each attention implementation the row declares and this transformers version runs
(others are skipped with the reason): (a) a full device budget is bit-identical to DynamicCache (tokens and
logits); (b) a small device budget that recalls every page gives DynamicCache's greedy tokens, logits within
the dtype's tolerance; (c) eviction runs and drops entries. Refused rows: one `UnsupportedError` naming the
reason.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import archs
from checks import EVICT, FULL, SMALL, assert_identical, assert_same_greedy, dynamic, full_layers, generate, tiered
from kvtier import UnsupportedError

NEW = 12
CELLS = [pytest.param(a.name, d, attn, id=f"{a.name}-{d}-{attn}")
         for a in archs.ARCHS if a.supported for d in archs.DTYPES for attn in archs.ATTNS]
REFUSED = [pytest.param(a.name, id=a.name) for a in archs.ARCHS if not a.supported]

_references: dict[tuple[str, str, str], object] = {}


def _reference(name: str, dtype: str, attn: str):
    """DynamicCache's greedy generation for the cell (computed once, before any TieredCache touches the model)."""
    key = (name, dtype, attn)
    if key not in _references:
        model = archs.model(name, dtype, attn)
        ref = generate(model, dynamic(model), archs.prompt(), NEW)
        again = generate(model, dynamic(model), archs.prompt(), NEW)
        assert_identical(again, ref)   # the reference itself is deterministic
        assert ref.sequences.shape == (1, archs.PROMPT + NEW)
        _references[key] = ref
    return _references[key]


def _check_saw_everything(cache) -> None:
    # transformers may swap a cache for its own (Phi-3's long-rope switch does); the tiered cache must have run
    assert cache.stats()["tokens_seen"] == archs.PROMPT + NEW - 1


def test_every_row_states_its_outcome():
    assert len([a for a in archs.ARCHS if a.supported]) >= 12
    for arch in archs.ARCHS:
        assert arch.supported or arch.expect.startswith("refused: ") and arch.refusal, arch


@pytest.mark.parametrize("name", [pytest.param(a.name, id=a.name) for a in archs.ARCHS if "sdpa" not in a.attn])
def test_rows_without_sdpa_are_right_that_transformers_lacks_it(name):
    """A row that declares eager only must say so because transformers cannot run it under sdpa."""
    cfg = archs.make_config(archs.BY_NAME[name])
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(cfg)]
    assert not getattr(model_class, "_supports_sdpa", False), f"{model_class.__name__} supports sdpa now"


@pytest.mark.parametrize("name,dtype,attn", CELLS)
def test_full_budget_is_bit_identical(name, dtype, attn):
    ref = _reference(name, dtype, attn)
    model = archs.model(name, dtype, attn)
    with tiered(model, **FULL) as cache:
        got = generate(model, cache, archs.prompt(), NEW)
        _check_saw_everything(cache)
    assert_identical(got, ref)


@pytest.mark.parametrize("name,dtype,attn", CELLS)
def test_small_budget_with_full_recall_matches(name, dtype, attn):
    ref = _reference(name, dtype, attn)
    model = archs.model(name, dtype, attn)
    with tiered(model, **SMALL) as cache:
        got = generate(model, cache, archs.prompt(), NEW)
        _check_saw_everything(cache)
        stats = cache.stats()
    assert_same_greedy(got, ref, archs.DTYPES[dtype])
    if full_layers(model.config):
        assert stats["bytes_moved"]["device_to_host"] > 0, "nothing was demoted: the budget did not bite"
        assert stats["pages_recalled"] + stats["pages_reused"] > 0, "no page was recalled"


@pytest.mark.parametrize("name,dtype,attn", CELLS)
def test_eviction_runs(name, dtype, attn):
    model = archs.model(name, dtype, attn)
    with tiered(model, **EVICT) as cache:
        got = generate(model, cache, archs.prompt(), NEW)
        _check_saw_everything(cache)
        stats = cache.stats()
    assert got.sequences.shape == (1, archs.PROMPT + NEW)
    assert len(got.logits) == NEW and all(torch.isfinite(step).all() for step in got.logits)
    if full_layers(model.config):
        assert stats["tokens_dropped"] > 0


@pytest.mark.parametrize("name", REFUSED)
def test_refused_with_one_clear_error(name):
    arch = archs.BY_NAME[name]
    model = archs.model(name)
    ids = archs.prompt(64)
    generate(model, dynamic(model), ids, 2)   # the model itself runs: the refusal is kvtier's
    with pytest.raises(UnsupportedError) as info:
        with tiered(model, **SMALL) as cache:
            generate(model, cache, ids, 2)
    assert arch.refusal in str(info.value), str(info.value)


@pytest.mark.parametrize("name", [pytest.param(a.name, id=a.name) for a in archs.ARCHS if a.supported])
def test_decode_graph_steps_equal_ordinary_ones(name):
    """`DecodeGraph` on each architecture (the GPU's recall path forced, launches eager on a CPU): its steps give
    the ordinary steps' logits bit for bit; where every layer is tiered its one-token steps are planned whole
    (a ready mask handed to the model, which transformers takes as it is), elsewhere they run the ordinary way."""
    from kvtier import TieredCache, cache_kwargs
    from kvtier.integrations.model_graph import DecodeGraph

    attn = archs.BY_NAME[name].attn[-1]
    model = archs.model(name, "float32", attn)
    runs = []
    for graphed in (False, True):
        with TieredCache(model.config, device_budget=48, recall_pages=2, prefetch_pages=2, scorer="keynorm") as c:
            c.take_gpu_path()
            step = DecodeGraph(model, c) if graphed else (lambda t, c=c: model(t, **cache_kwargs(c)).logits)
            with torch.no_grad():
                logits, got = step(archs.prompt())[:, -1:], []
                for _ in range(8):
                    logits = step(logits.argmax(-1))[:, -1:].clone()
                    got.append(logits)
            runs.append(torch.cat(got))
            every = len(c._engines) == len(c.layers)
    assert torch.equal(runs[1], runs[0])
    planned = step.stats()
    assert (planned["eager"] == 7) if every else (planned["eager"] == 0 and planned["ordinary"] == 9), planned


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gpt-oss", "gemma2", "gemma3", "llama"])
def test_steps_on_the_gpu_replay_as_eager_ones_and_whole_steps_as_ordinary_ones(name, cuda_device):
    """On a GPU, with partial recall: the layers' steps replayed from CUDA graphs, and whole steps through
    `DecodeGraph`, give the eager steps' logits bit for bit. The rows are the attention kvtier computes itself
    with something more than a softmax: GPT-OSS's sinks, Gemma 2's soft-capped scores (capped by the kernels),
    Gemma 3's sliding-window layers beside full ones (whose steps `DecodeGraph` leaves ordinary), and Llama's
    plain attention."""
    import copy

    from kvtier import DecodeGraph, TieredCache, cache_kwargs, native

    if native.kernel_status() is not None:
        pytest.skip(f"native kernels are off ({native.kernel_status()}): no step runs as launches only")
    attn = archs.BY_NAME[name].attn[0]   # eager: every row runs it
    model = copy.deepcopy(archs.model(name, "float32", attn)).to(cuda_device)   # the shared one stays on the CPU
    ids = archs.prompt().to(cuda_device)
    runs = {}
    for how in ("eager", "graphs", "whole steps"):
        with TieredCache(model.config, device_budget=48, recall_pages=2, prefetch_pages=2, scorer="keynorm",
                         cuda_graphs=how != "eager") as c:
            step = DecodeGraph(model, c) if how == "whole steps" else \
                (lambda t, c=c: model(t, **cache_kwargs(c)).logits)
            with torch.no_grad():
                logits, got = step(ids)[:, -1:], []
                for _ in range(24):
                    logits = step(logits.argmax(-1))[:, -1:].clone()
                    got.append(logits)
            assert c.stats()["pages_recalled"] > 0
            runs[how] = (torch.cat(got).cpu(), c.stats()["cuda_graphs"])
    assert torch.equal(runs["graphs"][0], runs["eager"][0])
    assert torch.equal(runs["whole steps"][0], runs["eager"][0])
    g = runs["graphs"][1]
    assert g["failed"] is None and g["replays"] > g["eager_steps"], g
