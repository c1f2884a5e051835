"""Random settings on random architectures, used at random: prompt chunks, greedy steps, parking on the host or
on disk, resuming, deep copies, and `DecodeGraph`'s steps. The other tests fix one setting at a time; these mix
them (budgets as counts and fractions, page sizes, demotion batches, host budgets that put pages on disk,
reading ahead, promotion, retained and prefetched pages, every built-in scorer, recall planned on either side)
where a combination nobody wrote a test for may break the bookkeeping.

What must hold whatever the mix:
- with every demoted page recalled, the logits follow `DynamicCache`'s within float32's part-by-part tolerance;
- with partial recall, a cache parked, resumed or copied between steps goes on bit for bit as a twin that was not;
- `DecodeGraph`'s steps give the ordinary steps' bits.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import archs
from checks import TOLERANCE, dynamic
from kvtier import DecodeGraph, TieredCache, cache_kwargs

# every supported row but Phi-3's longrope, whose prompts must stay short (archs.LONGROPE_NOTE)
NAMES = [a.name for a in archs.ARCHS if a.supported and a.name != "phi3-longrope"]
SCORERS = ["keynorm", "keydiff", "recency", "random", "tova", "snapkv", "h2o"]

ARCH = st.tuples(st.sampled_from(NAMES), st.sampled_from(["eager", "sdpa"]))
BUDGET = st.one_of(st.integers(8, 80), st.sampled_from([0.05, 0.1, 0.2, 0.35]))
HOST = st.one_of(st.none(), st.integers(0, 64), st.sampled_from([0.1, 0.3]))
SETTINGS = dict(device_budget=BUDGET, host_budget=HOST, page_size=st.sampled_from([4, 8, 16]),
                demote_pages=st.sampled_from([None, 1, 2, 3]), read_ahead=st.sampled_from([None, True, False]),
                promote=st.booleans(), prefetch_pages=st.sampled_from([None, 0, 2]), scorer=st.sampled_from(SCORERS))
USE = st.one_of(st.tuples(st.just("chunk"), st.integers(1, 60)), st.tuples(st.just("step"), st.integers(1, 6)),
                st.sampled_from([("park", "host"), ("park", "disk"), ("resume",), ("copy",)]))
USES = st.lists(USE, min_size=1, max_size=8)
RUNS = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _model(arch):
    name, attn = arch
    if attn not in archs.BY_NAME[name].attn or (attn == "sdpa" and archs.sdpa_unsupported(archs.BY_NAME[name])):
        attn = "eager"
    return archs.model(name, "float32", attn)


class Run:
    """A TieredCache `a` and a reference `b` fed the same tokens; `check` compares each forward's last logits."""

    def __init__(self, model, a, b, check, seed: int, on_device: bool) -> None:
        self.model, self.a, self.b, self.check, self.on_device = model, a, b, check, on_device
        self.g = torch.Generator().manual_seed(seed)
        self.seen, self.last = 0, None

    @torch.no_grad()
    def feed(self, ids: torch.Tensor, step=None) -> None:
        x = (step or (lambda t: self.model(t, **cache_kwargs(self.a)).logits))(ids)[:, -1]
        y = self.model(ids, **cache_kwargs(self.b)).logits[:, -1]
        self.seen += ids.shape[1]
        self.check(x, y, self.seen)
        self.last = y

    def chunk(self, n: int, step=None) -> None:
        self.feed(torch.randint(3, self.model.config.vocab_size, (1, n), generator=self.g), step)

    def steps(self, n: int, step=None) -> None:
        for _ in range(n):
            self.feed(self.last.argmax(-1, keepdim=True), step)

    def use(self, op: tuple) -> None:
        if op[0] == "chunk":
            self.chunk(op[1])
        elif op[0] == "step":
            self.steps(op[1])
        elif op[0] == "park":
            self.a.park(op[1])
        elif op[0] == "resume":
            self.a.resume()
            assert self.a.parked is None
        else:   # a parked cache is resumed before it is copied (a copy of one is refused)
            if self.a.parked is not None:
                self.a.resume()
            twin = copy.deepcopy(self.a)
            self.a.close()
            self.a = twin.take_gpu_path() if self.on_device else twin
        assert self.a.get_seq_length() == self.seen


def _close(*caches) -> None:
    for c in caches:
        if isinstance(c, TieredCache):
            c.close()


@settings(max_examples=40, **RUNS)
@given(arch=ARCH, s=st.fixed_dictionaries(SETTINGS), on_device=st.booleans(), first=st.integers(1, 200),
       uses=USES, seed=st.integers(0, 2**16))
def test_every_page_recalled_follows_dynamic_cache(tmp_path, arch, s, on_device, first, uses, seed):
    model = _model(arch)
    a = TieredCache(model.config, disk_dir=tmp_path, recall_pages=10_000, **s)
    if on_device:
        a.take_gpu_path()

    def close_enough(x, y, seen):
        assert torch.allclose(x, y, **TOLERANCE[torch.float32]), \
            f"{arch} {s}: logits {(x - y).abs().max():.1e} apart after {seen} tokens"

    run = Run(model, a, dynamic(model), close_enough, seed, on_device)
    try:
        run.chunk(first)
        for op in uses:
            run.use(op)
        stats = run.a.stats()
        assert stats["tokens_seen"] == run.seen
    finally:
        _close(run.a)


@settings(max_examples=40, **RUNS)
@given(arch=ARCH, s=st.fixed_dictionaries(SETTINGS), on_device=st.booleans(), recall=st.sampled_from([1, 2, 5]),
       retain=st.sampled_from([0, 1, 3]), first=st.integers(1, 200), uses=USES, seed=st.integers(0, 2**16))
def test_a_cache_parked_resumed_or_copied_goes_on_as_its_twin(tmp_path, arch, s, on_device, recall, retain, first,
                                                            uses, seed):
    model = _model(arch)
    twins = [TieredCache(model.config, disk_dir=tmp_path, recall_pages=recall,
                         retain_pages=0 if on_device else retain, **s) for _ in range(2)]
    if on_device:
        twins = [c.take_gpu_path() for c in twins]

    def same(x, y, seen):
        assert torch.equal(x, y), f"{arch} {s}: logits {(x - y).abs().max():.1e} apart after {seen} tokens"

    run = Run(model, *twins, same, seed, on_device)
    try:
        run.chunk(first)
        for op in uses:
            run.use(op)
    finally:
        _close(run.a, run.b)


@settings(max_examples=20, **RUNS)
@given(arch=ARCH, s=st.fixed_dictionaries(SETTINGS), recall=st.sampled_from([1, 2, 5, 10_000]),
       first=st.integers(1, 200), uses=USES, seed=st.integers(0, 2**16))
def test_decode_graph_steps_equal_ordinary_ones(tmp_path, arch, s, recall, first, uses, seed):
    model = _model(arch)
    a, b = (TieredCache(model.config, disk_dir=tmp_path, recall_pages=recall, **s).take_gpu_path()
            for _ in range(2))
    graph, calls = DecodeGraph(model, a), []

    def through_graph(ids):
        calls.append(ids.shape[1])
        return graph(ids)

    def same(x, y, seen):
        assert torch.equal(x, y), f"{arch} {s}: logits {(x - y).abs().max():.1e} apart after {seen} tokens"

    run = Run(model, a, b, same, seed, on_device=True)
    try:
        run.chunk(first)
        for op in uses:
            if op[0] == "copy":   # a DecodeGraph keeps stepping its own cache
                continue
            if op[0] == "step":
                run.steps(op[1], through_graph)
            elif op[0] == "chunk" and op[1] % 2:
                run.chunk(op[1], through_graph)   # a prompt through it runs the ordinary way
            else:
                run.use(op)
        took = graph.stats()
        assert took["replays"] + took["eager"] + took["ordinary"] == len(calls), took   # each step counted once
    finally:
        _close(run.a, run.b)


def test_the_random_uses_reach_every_tier(tmp_path):
    """The strategies above do put pages on the host and on disk and bring them back (a mix like theirs)."""
    model = archs.model("llama")
    cache = TieredCache(model.config, disk_dir=tmp_path, device_budget=24, host_budget=16, page_size=4,
                        recall_pages=10_000, scorer="keynorm")
    run = Run(model, cache, dynamic(model), lambda x, y, seen: None, 0, False)
    try:
        run.chunk(120)
        run.steps(3)
        stats = cache.stats()
        assert stats["host"]["tokens"] > 0 and stats["disk"]["tokens"] > 0
        assert stats["pages_recalled_from"]["host"] > 0 and stats["pages_recalled_from"]["disk"] > 0
    finally:
        cache.close()


@pytest.fixture(autouse=True)
def _no_leftover(tmp_path):
    """Each cache removes its own folder inside `disk_dir` on close."""
    yield
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())
