"""The device pool's `take` and `remove` against a plain per-head list of entries, across slab counts: the
same entries come out, and the last entries fill the holes exactly as a per-head loop would place them."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.device import DevicePool


def _reference_remove(rows: list[list[int]], gone: list[list[int]]) -> list[list[int]]:
    """Per head: the tail entries that stay move, in order, into the dropped entries below the tail (in the
    order they were given)."""
    out = []
    for row, drop in zip(rows, gone):
        row, new = list(row), len(row) - len(drop)
        holes = [i for i in drop if i < new]
        movers = [i for i in range(new, len(row)) if i not in drop]
        for hole, mover in zip(holes, movers):
            row[hole] = row[mover]
        out.append(row[:new])
    return out


@settings(max_examples=80, deadline=None, derandomize=True)
@given(heads=st.integers(1, 3), slab=st.integers(1, 9), start=st.integers(1, 40), seed=st.integers(0, 2**16),
       steps=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 12), st.booleans()), min_size=1, max_size=6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_take_and_remove_follow_a_per_head_reference(heads, slab, start, seed, steps, dtype):
    rng = np.random.default_rng(seed)
    dim, pool = 3, DevicePool(heads, 3, dtype, torch.device("cpu"), slab)
    ids = [list(range(start)) for _ in range(heads)]        # entry i of head h holds token ids[h][i]
    written = 0

    def write(n: int) -> None:
        nonlocal written
        tok = torch.arange(written, written + n)
        k = (tok[None, None, :, None] * 10 + torch.arange(heads)[None, :, None, None]).to(dtype).expand(
            1, heads, n, dim)
        pool.stage(k.contiguous(), (-k).contiguous(), tok.expand(heads, n))
        pool.commit(n, tok.float().expand(heads, n) / 7)
        written += n

    write(start)
    for add, drop, singly in steps:
        if add:   # at once (a prefill chunk), or a token at a time (decode steps: written where `at` says)
            for n in [1] * add if singly else [add]:
                write(n)
                assert pool._at is None or int(pool._at) == pool._at_holds   # the host knows what it holds
            for h in range(heads):
                ids[h] += list(range(written - add, written))
        n = pool.count
        m = min(drop, n)
        gone = [rng.choice(n, size=m, replace=False).tolist() for _ in range(heads)]   # any order
        idx = torch.tensor(gone, dtype=torch.int64).reshape(heads, m)
        k, v = pool.take(idx)
        for h in range(heads):
            want = torch.tensor([ids[h][i] for i in gone[h]])
            assert torch.equal(k[h, :, 0].float(), (want * 10 + h).to(dtype).float())
            assert torch.equal(v[h], -k[h])
        pool.remove(idx)
        ids = _reference_remove(ids, gone)
        pos, score = pool.meta()
        assert pool.count == n - m
        assert pos.tolist() == ids
        assert torch.equal(score, pos.float() / 7)
        keys, values = pool.contiguous(pool.count)
        for h in range(heads):
            assert torch.equal(keys[0, h, :, 1].float(), (torch.tensor(ids[h]) * 10 + h).to(dtype).float())
            assert torch.equal(values[0, h], -keys[0, h])
        pool.trim()
        assert int(pool.at()) == pool.count % slab and int(pool._at) == pool._at_holds


def test_a_decode_step_of_another_dtype_is_stored_in_the_pools():
    """A decode step's entry goes where the pool's count on the device says, cast to the pool's dtype as a
    longer step's is (autocast may hand a step keys of another dtype than the first step's)."""
    pool = DevicePool(2, 4, torch.bfloat16, torch.device("cpu"), 8)
    pool.stage(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), torch.zeros(2, 3, dtype=torch.int64))
    pool.commit(3, torch.zeros(2, 3))
    k = torch.full((1, 2, 1, 4), 1.5, dtype=torch.float32)
    pool.stage(k, -k, torch.full((2, 1), 3, dtype=torch.int64))
    pool.commit(1, torch.full((2, 1), 0.25, dtype=torch.bfloat16))
    keys, values = pool.contiguous(4)
    assert keys.dtype == torch.bfloat16 and torch.equal(keys[0, :, 3], k[0, :, 0].bfloat16())
    assert torch.equal(values[0, :, 3], -k[0, :, 0].bfloat16())
    assert pool.meta()[0][:, 3].tolist() == [3, 3] and pool.meta()[1][:, 3].tolist() == [0.25, 0.25]


def test_a_step_that_failed_between_its_launches_and_the_hosts_part_leaves_no_stale_place():
    """A decode step's launches move the place on the device (`commit_launches`); if the step fails before the
    host's part (`note_commit`), the device is one ahead of what the host believes. After `clear` (what a
    reset does) or `forget_at` (what a failed step does), the next decode entry goes where the count says."""
    for recover in ("clear", "forget_at"):
        pool = DevicePool(1, 2, torch.float32, torch.device("cpu"), 8)
        prompt = torch.arange(6.0).reshape(1, 1, 3, 2)
        pool.stage(prompt, prompt, torch.arange(3).reshape(1, 3))
        pool.commit(3, torch.zeros(1, 3))
        pool.stage(torch.full((1, 1, 1, 2), 7.0), torch.full((1, 1, 1, 2), 7.0), torch.full((1, 1), 3))
        pool.at()
        pool.commit_launches(torch.zeros(1, 1))   # the step fails here, before note_commit
        if recover == "clear":
            pool.clear()
            pool.stage(prompt, prompt, torch.arange(3).reshape(1, 3))
            pool.commit(3, torch.zeros(1, 3))
        else:
            pool.forget_at()
        token = torch.full((1, 1, 1, 2), 9.0)
        pool.stage(token, token, torch.full((1, 1), 3))
        pool.commit(1, torch.ones(1, 1))
        keys, _ = pool.contiguous(4)
        assert keys[0, 0, 3].tolist() == [9.0, 9.0], recover
        assert pool.meta()[1][0, 3].item() == 1.0, recover


def test_the_slab_addresses_follow_the_slabs_through_growth_trim_and_clear(monkeypatch):
    """`addresses()` is kept for the kernels until the slabs change: adding, releasing (`trim`) or dropping
    them all (`clear`) must never leave a table that names freed slabs."""
    from kvtier import native

    monkeypatch.setattr(native, "slab_addresses",
                        lambda slabs, device: torch.tensor([s.data_ptr() for s in slabs], dtype=torch.int64))

    def current(pool):
        return [[s.data_ptr() for s in pool.k], [s.data_ptr() for s in pool.v]]

    pool = DevicePool(2, 8, torch.float32, torch.device("cpu"), 4)
    assert pool.addresses() is None                       # no slab yet
    pool.stage(torch.zeros(1, 2, 10, 8), torch.zeros(1, 2, 10, 8), torch.zeros(2, 10, dtype=torch.int64))
    first = pool.addresses()
    assert [a.tolist() for a in first] == current(pool) and len(pool.k) == 3
    assert pool.addresses() is first                      # kept while the slabs stay
    pool.commit(5, torch.zeros(2, 5))
    pool.trim()                                           # 5 committed entries: two slabs stay
    assert len(pool.k) == 2 and [a.tolist() for a in pool.addresses()] == current(pool)
    pool.clear()
    assert pool.addresses() is None
    pool.stage(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), torch.zeros(2, 3, dtype=torch.int64))
    assert [a.tolist() for a in pool.addresses()] == current(pool)
