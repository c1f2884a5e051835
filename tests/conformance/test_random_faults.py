"""Random I/O faults (disk full, I/O error, too many open files, file too large) at a random call of `os.pwritev`,
`os.preadv`, `os.write`, `os.open` or `os.fsync`, during random uses of a cache with pages on disk (prompt chunks,
greedy steps, parks, resumes), on the CPU's path or the GPU's (`take_gpu_path`: recall planned on the device, through
the kernels' twins). Whatever fails and wherever, the cache
- completes the use (a failed read ahead is read again on demand; host pages the disk refuses stay on the host), or
- raises a kvtier error and is as it was: the same use again, without the fault, gives its untouched twin's bits, or
- raises a kvtier error and is broken: every later use says so.

Never a wrong answer, never a raw `OSError`.
"""

from __future__ import annotations

import contextlib
import errno
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import archs
from kvtier import BrokenCacheError, KVTierError, TieredCache, cache_kwargs

NAMES = ["llama", "gemma3", "gpt-oss", "qwen2"]
SITES = ["pwritev", "preadv", "write", "open", "fsync"]
ERRORS = [errno.ENOSPC, errno.EIO, errno.EMFILE, errno.EFBIG]

USE = st.one_of(st.tuples(st.just("chunk"), st.integers(1, 50)), st.tuples(st.just("step"), st.integers(1, 4)),
                st.sampled_from([("park", "host"), ("park", "disk"), ("resume",)]))
FAULT = st.one_of(st.none(), st.tuples(st.sampled_from(SITES), st.integers(0, 4), st.sampled_from(ERRORS)))
SETTINGS = dict(device_budget=st.sampled_from([16, 24, 0.1, 0.2]), host_budget=st.sampled_from([0, 8, 16, 32, None]),
                page_size=st.sampled_from([4, 16]), read_ahead=st.sampled_from([None, True, False]),
                promote=st.booleans(), recall_pages=st.sampled_from([2, 10_000]))


@contextlib.contextmanager
def failing(site: str, n: int, err: int):
    """``os.<site>`` raises ``OSError(err)`` on its `n`-th call (from 0) inside the block; yields whether it did."""
    real, calls, fired = getattr(os, site), [0], []

    def call(*args, **kwargs):
        calls[0] += 1
        if calls[0] - 1 == n:
            fired.append(True)
            raise OSError(err, os.strerror(err))
        return real(*args, **kwargs)

    setattr(os, site, call)
    try:
        yield fired
    finally:
        setattr(os, site, real)


def _where(cache: TieredCache) -> list[str | None]:
    """Where each tiered layer is parked (None: in use)."""
    return [None if engine.parked is None else engine.parked.where for engine in cache._engines]


class Twins:
    """A cache `a` that meets the faults and an untouched twin `b`, fed the same uses."""

    def __init__(self, model, a, b, seed: int) -> None:
        self.model, self.a, self.b = model, a, b
        self.g = torch.Generator().manual_seed(seed)
        self.last: torch.Tensor | None = None

    @torch.no_grad()
    def forward(self, cache, ids) -> torch.Tensor:
        return self.model(ids, **cache_kwargs(cache)).logits[:, -1]

    def inputs(self, use: tuple) -> list[torch.Tensor] | None:
        """The token batches of a chunk (drawn now); a step's tokens are its own greedy choices."""
        return [torch.randint(3, self.model.config.vocab_size, (1, use[1]), generator=self.g)] if use[0] == "chunk" \
            else None

    def do(self, cache, use, batches, tokens: list, out: list) -> None:
        """Apply `use` to `cache`, the logits of each forward appended to `out`; a step replays `tokens` where they
        are given, else records its own. Goes on from where `out` stands (a use that failed midway, tried again)."""
        if use[0] == "chunk":
            out.append(self.forward(cache, batches[0]))
        elif use[0] == "step":
            x = out[-1] if out else self.last
            for i in range(len(out), use[1]):
                if len(tokens) <= i:
                    tokens.append(x.argmax(-1, keepdim=True))
                x = self.forward(cache, tokens[i])
                out.append(x)
        elif use[0] == "park":
            cache.park(use[1])
        else:
            cache.resume()


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=st.sampled_from(NAMES), s=st.fixed_dictionaries(SETTINGS), first=st.integers(20, 200),
       uses=st.lists(st.tuples(USE, FAULT), min_size=1, max_size=8), seed=st.integers(0, 999),
       on_device=st.booleans())
def test_a_fault_anywhere_leaves_the_cache_as_it_was_or_broken(tmp_path, name, s, first, uses, seed, on_device):
    model = archs.model(name, "float32", archs.BY_NAME[name].attn[0])
    caches = [TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **s) for _ in range(2)]
    twins = Twins(model, *(c.take_gpu_path() if on_device else c for c in caches), seed)
    a, b = twins.a, twins.b
    try:
        prompt = twins.inputs(("chunk", first))[0]
        twins.last = twins.forward(a, prompt)
        assert torch.equal(twins.last, twins.forward(b, prompt))
        for use, fault in uses:
            batches, tokens, got, error = twins.inputs(use), [], [], None
            where = _where(a)
            with failing(*fault) if fault else contextlib.nullcontext():
                try:
                    twins.do(a, use, batches, tokens, got)
                except Exception as e:   # checked below: a kvtier error, never a raw OSError
                    error = e
            if error is not None:
                assert isinstance(error, KVTierError), f"{type(error).__name__}: {error} ({use}, {fault})"
                if a.broken is not None:   # every later use says so
                    try:
                        twins.forward(a, torch.tensor([[5]]))
                    except BrokenCacheError:
                        return
                    raise AssertionError(f"a broken cache ({a.broken}) took a step")
                if use[0] == "park":   # every layer where it was (a step may bring parked layers back as it goes)
                    assert _where(a) == where, (use, fault, error)
                twins.do(a, use, batches, tokens, got)   # as it was: the rest of the use again, without the fault
            want: list[torch.Tensor] = []
            twins.do(b, use, batches, tokens, want)
            assert len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want)), (use, fault)
            assert a.get_seq_length() == b.get_seq_length()
            if want:
                twins.last = want[-1]
    finally:
        a.close()
        b.close()
