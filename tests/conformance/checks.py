"""Running a model on a cache and comparing what two caches gave."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from transformers import DynamicCache

from kvtier import TieredCache, cache_kwargs

# tiered settings
FULL = dict(device_budget=1.0)                        # everything stays on the device
SMALL = dict(device_budget=40, recall_pages=64)       # demotes most of a 300-token prompt; recalls every page
EVICT = dict(mode="evict", device_budget=0.2)

# how far logits may drift when attention is computed over recalled pages part by part
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def dynamic(model: torch.nn.Module) -> DynamicCache:
    return DynamicCache(config=model.config)


@contextlib.contextmanager
def tiered(model: torch.nn.Module, **settings: Any) -> Iterator[TieredCache]:
    """A TieredCache on `model` (keynorm scorer); closed, and the model's attention given back, afterwards."""
    cache = TieredCache(model.config, scorer="keynorm", **settings)
    try:
        yield cache
    finally:
        cache.close()
        cache.detach_attention()


def generate(model: torch.nn.Module, cache: Any, ids: torch.Tensor | None = None, new: int = 12,
             **kwargs: Any) -> Any:
    """Greedy generation (unless `kwargs` say otherwise) returning the sequences and the raw logits."""
    kwargs.setdefault("do_sample", False)
    return model.generate(ids, **cache_kwargs(cache), max_new_tokens=new, output_logits=True,
                          return_dict_in_generate=True, **kwargs)


def forward(model: torch.nn.Module, cache: Any, ids: torch.Tensor, **kwargs: Any) -> Any:
    with torch.no_grad():
        return model(ids, **cache_kwargs(cache), **kwargs)


def assert_identical(got: Any, ref: Any) -> None:
    """The same tokens and bit-identical logits at every step."""
    new = len(ref.logits)
    assert torch.equal(got.sequences, ref.sequences), \
        f"tokens differ:\n got {got.sequences[0, -new:].tolist()}\n ref {ref.sequences[0, -new:].tolist()}"
    assert len(got.logits) == len(ref.logits)
    for step, (g, r) in enumerate(zip(got.logits, ref.logits)):
        assert torch.equal(g, r), f"logits of step {step} differ (max {(g.float() - r.float()).abs().max():.3g})"


def assert_same_greedy(got: Any, ref: Any, dtype: torch.dtype) -> None:
    """The same greedy tokens as `ref`, with logits within the dtype's tolerance at every step.

    The one allowance is a numerical tie: where the reference's two candidates are closer than the tolerance
    (bf16 logits of a tiny random model tie exactly at times), the choice between them may flip; the
    continuations differ from there on, so the comparison stops at that step.
    """
    tol = TOLERANCE[dtype]
    assert got.sequences.shape == ref.sequences.shape, (got.sequences.shape, ref.sequences.shape)
    new = len(ref.logits)
    got_tokens, ref_tokens = got.sequences[0, -new:].tolist(), ref.sequences[0, -new:].tolist()
    assert torch.equal(got.sequences[:, :-new], ref.sequences[:, :-new])
    for step, (g, r) in enumerate(zip(got.logits, ref.logits)):
        torch.testing.assert_close(g.float(), r.float(), **tol,
                                   msg=lambda m, step=step: f"logits of step {step}: {m}")
        if got_tokens[step] != ref_tokens[step]:
            margin = float(r[0, ref_tokens[step]] - r[0, got_tokens[step]])
            assert margin <= 2 * tol["atol"], (
                f"step {step}: token {got_tokens[step]} instead of {ref_tokens[step]}, which led by {margin:.3g} "
                f"(more than a tie); got {got_tokens}, ref {ref_tokens}")
            return


def full_layers(config: Any) -> bool:
    """Whether the model has a full-attention layer (the layers kvtier tiers)."""
    from archs import layer_kinds

    return "full_attention" in layer_kinds(config)
