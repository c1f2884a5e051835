"""Random sequences of what a user does with a cache (prompt chunks, greedy generation, parking on the host
or on disk, resuming, resetting, deep copies), checked against a `DynamicCache` fed the same tokens: with every demoted
page recalled at each step, the greedy tokens are the same at every generation."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from kvtier import TieredCache, UnsupportedError, cache_kwargs

SETTINGS = dict(device_budget=24, host_budget=16, recall_pages=10_000, scorer="keynorm")

OPS = st.one_of(
    st.tuples(st.just("chunk"), st.integers(1, 60)),
    st.tuples(st.just("generate"), st.integers(1, 4)),
    st.sampled_from([("park", "host"), ("park", "disk"), ("resume",), ("reset",), ("copy",)]),
)




@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sequences")


class Pair:
    """A TieredCache and a DynamicCache fed the same tokens; the last logits of each."""

    def __init__(self, model, disk_dir) -> None:
        self.model = model
        self.tiered = TieredCache(model.config, disk_dir=disk_dir, **SETTINGS)
        self.full = DynamicCache(config=model.config)
        self.logits: tuple[torch.Tensor, torch.Tensor] | None = None
        self.seen = 0

    @torch.no_grad()
    def feed(self, ids: torch.Tensor) -> None:
        t = self.model(ids, **cache_kwargs(self.tiered)).logits[:, -1]
        f = self.model(ids, **cache_kwargs(self.full)).logits[:, -1]
        self.logits = (t, f)
        self.seen += ids.shape[1]

    def generate(self, n: int) -> list[int]:
        if self.logits is None:
            self.feed(torch.zeros(1, 1, dtype=torch.long))
        tokens = []
        for _ in range(n):
            t, f = (int(x.argmax(-1)) for x in self.logits)
            assert t == f, f"greedy token {t} != {f} after {self.seen} tokens"
            tokens.append(t)
            self.feed(torch.tensor([[t]]))
        return tokens

    def copy(self) -> None:
        """Go on with deep copies of both caches; the tiered original is closed (the copy owns its own tiers)."""
        if self.tiered.parked is not None:
            with pytest.raises(UnsupportedError, match="resume"):
                copy.deepcopy(self.tiered)
            return
        twin = copy.deepcopy(self.tiered)
        self.tiered.close()
        self.tiered, self.full = twin, copy.deepcopy(self.full)

    def reset(self) -> None:
        self.tiered.reset()
        self.full = DynamicCache(config=self.model.config)
        self.logits, self.seen = None, 0


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(first=st.integers(0, 100), ops=st.lists(OPS, min_size=2, max_size=12), seed=st.integers(0, 2**16))
def test_random_sequences_match_dynamic_cache(model, disk_dir, first, ops, seed):
    g = torch.Generator().manual_seed(seed)
    pair = Pair(model, disk_dir)
    try:
        for op in ([("chunk", first)] if first else []) + ops:   # a first prompt, long enough for the disk
            if op[0] == "chunk":
                pair.feed(torch.randint(0, 128, (1, op[1]), generator=g))
            elif op[0] == "generate":
                pair.generate(op[1])
            elif op[0] == "park":
                pair.tiered.park(op[1])
                if pair.seen:   # (an empty cache has nothing to park)
                    assert pair.tiered.parked in (op[1], "disk")   # host after disk stays on disk
            elif op[0] == "copy":
                pair.copy()
            elif op[0] == "resume":
                pair.tiered.resume()
                assert pair.tiered.parked is None
            else:
                pair.reset()
            assert pair.tiered.get_seq_length() == pair.seen
        pair.generate(2)   # every sequence ends by generating
        stats = pair.tiered.stats()
        assert stats["tokens_seen"] == pair.seen
        held = stats["device"]["tokens"] + stats["host"]["tokens"] + stats["disk"]["tokens"]
        assert held == pair.seen * stats["layers"] * stats["kv_heads"]   # nothing lost
    finally:
        pair.tiered.close()


def test_the_sequences_reach_every_tier(model, disk_dir):
    """The settings above do put pages on the host and on disk, and recall them."""
    pair = Pair(model, disk_dir)
    pair.feed(torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(0)))
    pair.generate(3)
    s = pair.tiered.stats()
    assert s["host"]["tokens"] > 0 and s["disk"]["tokens"] > 0
    assert s["pages_recalled_from"]["host"] > 0 and s["pages_recalled_from"]["disk"] > 0
    pair.tiered.close()
