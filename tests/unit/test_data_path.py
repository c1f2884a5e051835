"""The data path of the rewritten layer engine: whole pages only, exact split attention, per-block recall for
long queries, storage that grows without copying, and a device-resident recall index of 1/16 the demoted
bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.engine.attention import attend_split
from kvtier.placement.page_table import DISK, HOST


def _all_page_positions(engine):
    """``[heads, pages, page_size]`` positions of every page in the table."""
    return np.stack([np.stack([engine.table.positions(h, p) for p in range(engine.table.n)])
                     for h in range(engine.heads)])


# ---------------------------------------------------------------------------------------------- 1. whole pages
@pytest.mark.parametrize("budget", [24, 8])
def test_long_decode_keeps_pages_full_and_the_device_within_a_page_of_its_budget(make_engine, budget):
    """24: 18 unprotected entries, a page can always go; 8: only 2 unprotected under the budget, so entries
    wait on the device (above its budget) until they fill a page."""
    P = 4
    engine = make_engine(heads=2, head_dim=8, device_budget=budget, host_budget=16, page_size=P,
                         sink_tokens=2, recent_tokens=4, recall_pages=2)
    g = torch.Generator().manual_seed(0)
    total = 500 + 3000
    k_all = torch.randn(1, engine.heads, total, engine.head_dim, generator=g)
    v_all = torch.randn(1, engine.heads, total, engine.head_dim, generator=g)
    steps = [(0, 500)] + [(t, t + 1) for t in range(500, total)]
    checked, over = 0, 0
    for i, (a, b) in enumerate(steps):
        engine.write(k_all[:, :, a:b], v_all[:, :, a:b])
        if i % 500 == 1:   # now and then a decode step recalls through the tiers
            assert engine.attend(torch.randn(1, engine.heads * 2, b - a, engine.head_dim, generator=g)) is not None
        engine.commit()
        assert engine.pool.count <= budget + P - 1, f"device over budget by a page or more after step {i}"
        over += engine.pool.count > budget
        # pages never change once written: check each new page as it appears
        for pid in range(checked, engine.table.n):
            for h in range(engine.heads):
                at = engine.table.positions(h, pid)
                assert len(at) == P and (at >= 0).all() and (at < b).all(), f"page {pid} of head {h} not full"
        checked = engine.table.n
        held = engine.pool.count + engine.table.tokens(HOST) + engine.table.tokens(DISK)
        assert (held == b).all(), f"entries lost or invented after step {i}"
    if budget == 24:
        assert over == 0  # with 18 unprotected entries a whole page can always be found
    else:
        assert over > 0   # entries waited for a full page instead of going down as a partial one
    # at the end: the tiers partition the positions, every page is full and holds what was written there
    tier = engine.table.tier
    assert (tier == DISK).sum() > (tier == HOST).sum() > 0
    # every disk record is a disk page or a host page's clean copy (a page recall brought up and the host kept)
    assert engine.disk.pages() == int((tier == DISK).sum()) + int((engine.table.copy_slot >= 0).sum())
    pos, _ = engine.pool.meta()
    pages = _all_page_positions(engine)
    for h in range(engine.heads):
        everything = np.sort(np.concatenate([pos[h].numpy(), pages[h].reshape(-1)]))
        assert np.array_equal(everything, np.arange(total))
    for pid in range(0, engine.table.n, 37):  # a sample of pages, bit-exact from their tier
        for h in range(engine.heads):
            t, slot = engine.table.lookup(np.array([h]), np.array([pid]))
            pk, pv = (engine.host if t[0] == HOST else engine.disk).load(slot)
            at = torch.from_numpy(pages[h, pid])
            assert torch.equal(pk[0], k_all[0, h, at]) and torch.equal(pv[0], v_all[0, h, at])


# ----------------------------------------------------------------------------------------- 2. split attention
def _reference(query, past_k, past_v, new_k, new_v, new_from, scale):
    """Softmax over [past, new] in float64 with the causal mask; ``[1, L, q_heads, dim]``."""
    _, q_heads, L, dim = query.shape
    group = q_heads // new_k.shape[1]
    k = torch.cat([past_k, new_k], dim=2).double().repeat_interleave(group, dim=1)
    v = torch.cat([past_v, new_v], dim=2).double().repeat_interleave(group, dim=1)
    S_past = past_k.shape[2]
    logits = torch.matmul(query.double(), k.transpose(-1, -2)) * scale
    key_at = torch.arange(k.shape[2])
    row_at = S_past + new_from + torch.arange(L)      # query row i is new token new_from + i
    logits = logits.masked_fill(key_at[None, :] > row_at[:, None], float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1), v).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("past", ["parts", "empty_part", "none"])
@pytest.mark.parametrize("new_from", [0, 9])
@pytest.mark.parametrize("q_len", [1, 5, 300])
def test_split_attention_equals_causal_softmax_over_the_concatenation(q_len, new_from, past, dtype):
    g = torch.Generator().manual_seed(q_len * 100 + new_from)
    kv_heads, group, dim = 2, 3, 16
    sizes = {"parts": [37, 0, 128], "empty_part": [0], "none": []}[past]
    parts = [(torch.randn(1, kv_heads, n, dim, generator=g).to(dtype),
              torch.randn(1, kv_heads, n, dim, generator=g).to(dtype)) for n in sizes]
    new_k = torch.randn(1, kv_heads, new_from + q_len, dim, generator=g).to(dtype)
    new_v = torch.randn(1, kv_heads, new_from + q_len, dim, generator=g).to(dtype)
    query = (torch.randn(1, kv_heads * group, q_len, dim, generator=g) * 2).to(dtype)
    scale = dim ** -0.5
    out = attend_split(query, parts, new_k, new_v, new_from, scale)
    assert out.shape == (1, q_len, kv_heads * group, dim) and out.dtype == dtype
    empty = torch.empty(1, kv_heads, 0, dim, dtype=dtype)
    past_k = torch.cat([k for k, _ in parts], dim=2) if parts else empty
    past_v = torch.cat([v for _, v in parts], dim=2) if parts else empty
    ref = _reference(query, past_k, past_v, new_k, new_v, new_from, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    else:  # the output is rounded to bf16 (8 bits of mantissa)
        torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------------------- 3. long queries
def _exact_causal(query, k_all, v_all, first, scale, rows=256):
    """Plain causal attention of queries at positions ``first ..`` over ``k_all, v_all`` (float32)."""
    _, q_heads, L, dim = query.shape
    group = q_heads // k_all.shape[1]
    k = k_all.repeat_interleave(group, dim=1)
    v = v_all.repeat_interleave(group, dim=1)
    out = []
    for r in range(0, L, rows):
        q = query[:, :, r:r + rows]
        logits = torch.matmul(q, k.transpose(-1, -2)) * scale
        at = first + r + torch.arange(q.shape[2])
        logits.masked_fill_(torch.arange(k.shape[2])[None, :] > at[:, None], float("-inf"))
        out.append(torch.matmul(torch.softmax(logits, dim=-1), v))
    return torch.cat(out, dim=2).transpose(1, 2)


def _prefill(engine, k_all, v_all, upto, chunk=1024):
    for a in range(0, upto, chunk):
        engine.write(k_all[:, :, a:a + chunk], v_all[:, :, a:a + chunk])
        engine.commit()


def test_long_query_over_every_recalled_page_is_exact(make_engine, monkeypatch):
    engine = make_engine(heads=2, head_dim=16, device_budget=0.1, host_budget=0.5, page_size=16,
                         sink_tokens=4, recent_tokens=16, recall_pages=100_000)
    g = torch.Generator().manual_seed(1)
    old, new = 8192, 4096
    k_all = torch.randn(1, engine.heads, old + new, engine.head_dim, generator=g)
    v_all = torch.randn(1, engine.heads, old + new, engine.head_dim, generator=g)
    _prefill(engine, k_all, v_all, old)
    assert engine.pool.count <= 820 + 15 and engine.table.n * 16 >= old - 835
    tier = engine.table.tier
    assert (tier == HOST).any() and (tier == DISK).any()
    blocks = []
    real = engine._fetch
    monkeypatch.setattr(engine, "_fetch", lambda ids, short, ahead=False: blocks.append(ids.shape) or real(ids, short, ahead))
    engine.write(k_all[:, :, old:], v_all[:, :, old:])
    query = torch.randn(1, engine.heads * 3, new, engine.head_dim, generator=g)
    out, _ = engine.attend(query)
    assert blocks == [(engine.heads, engine.table.n)] * (new // 128)   # every block recalled every page
    ref = _exact_causal(query, k_all, v_all, old, engine.head_dim ** -0.5)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)
    engine.commit()  # the long step spans two device slabs: placing it keeps every entry, once, intact
    k, v = engine.pool.contiguous(engine.pool.count)
    pos, _ = engine.pool.meta()
    pages = _all_page_positions(engine)
    for h in range(engine.heads):
        assert torch.equal(k[0, h], k_all[0, h, pos[h]]) and torch.equal(v[0, h], v_all[0, h, pos[h]])
        everything = np.sort(np.concatenate([pos[h].numpy(), pages[h].reshape(-1)]))
        assert np.array_equal(everything, np.arange(old + new))
    assert engine.pool.count <= engine.cfg.device_tokens(old + new) + 15


def test_each_query_block_recalls_its_own_pages(make_engine, monkeypatch):
    engine = make_engine(heads=2, head_dim=16, device_budget=0.1, page_size=16, sink_tokens=4,
                         recent_tokens=16, recall_pages=2)
    g = torch.Generator().manual_seed(2)
    old, new = 8192, 4096
    k_all = torch.randn(1, engine.heads, old + new, engine.head_dim, generator=g) * 0.3
    v_all = torch.randn(1, engine.heads, old + new, engine.head_dim, generator=g)
    needles = torch.randn(2, engine.head_dim, generator=g)
    needles = needles / needles.norm(dim=1, keepdim=True)
    planted = (1000, 5000)
    for needle, p in zip(needles, planted):
        k_all[0, :, p] = needle * 12          # a large key norm: keynorm demotes it
    _prefill(engine, k_all, v_all, old)
    page_of = {}
    pages = _all_page_positions(engine)
    for p in planted:
        h_idx, pid_idx = np.nonzero((pages == p).any(axis=2))
        assert len(h_idx) == engine.heads, f"planted key {p} is not demoted in every head"
        page_of[p] = pid_idx
    fetched = []
    real = engine._fetch
    monkeypatch.setattr(engine, "_fetch", lambda ids, short, ahead=False: fetched.append(ids.clone()) or real(ids, short, ahead))
    engine.write(k_all[:, :, old:], v_all[:, :, old:])
    query = torch.randn(1, engine.heads * 3, new, engine.head_dim, generator=g) * 0.3
    query[:, :, :128] = needles[0] * 4       # block 0 asks for the first planted key
    query[:, :, 128:256] = needles[1] * 4    # block 1 for the second
    assert engine.attend(query)[0].shape == (1, new, engine.heads * 3, engine.head_dim)
    assert len(fetched) == new // 128 and all(ids.shape == (engine.heads, 2) for ids in fetched)
    for h in range(engine.heads):
        assert page_of[planted[0]][h] in fetched[0][h].tolist()
        assert page_of[planted[1]][h] in fetched[1][h].tolist()
        assert page_of[planted[1]][h] not in fetched[0][h].tolist()
        assert page_of[planted[0]][h] not in fetched[1][h].tolist()
    assert not torch.equal(fetched[0], fetched[1])


# ------------------------------------------------------------------------------------ 4. growth without copies
def test_host_pool_page_index_and_device_slabs_grow_without_copying(make_engine):
    engine = make_engine(heads=2, head_dim=128, device_budget=64, page_size=4, sink_tokens=2, recent_tokens=4)
    g = torch.Generator().manual_seed(3)
    total, chunk = 10_240, 512
    k_all = torch.randn(1, engine.heads, total, engine.head_dim, generator=g)
    engine.write(k_all[:, :, :chunk], k_all[:, :, :chunk])
    engine.commit()
    assert engine.table.n > 0
    parts = {"host.k": engine.host.k, "host.v": engine.host.v, "index.bounds": engine.index.bounds,
             "index.codes": engine.index.codes}
    first = {name: (part.slabs[0], id(part.slabs[0]), part.slabs[0].data_ptr(), len(part.slabs))
             for name, part in parts.items()}
    device_first = (engine.pool.k[0], id(engine.pool.k[0]), engine.pool.k[0].data_ptr())
    used = engine.table.n                                      # page ids (index rows) in use so far
    snap = {"index.bounds": engine.index.bounds.slabs[0][:used].clone(),
            "index.codes": engine.index.codes.slabs[0][:used].clone()}
    host_rows = engine.host.pages()
    snap["host.k"] = engine.host.k.slabs[0][:host_rows].clone()
    for a in range(chunk, total, chunk):
        engine.write(k_all[:, :, a:a + chunk], k_all[:, :, a:a + chunk])
        engine.commit()
    for name, part in parts.items():
        slab, ident, ptr, count = first[name]
        assert len(part.slabs) > count, f"{name} did not grow; make the test feed more"
        assert part.slabs[0] is slab and id(part.slabs[0]) == ident and part.slabs[0].data_ptr() == ptr, \
            f"{name} copied its first slab to grow"
    assert engine.pool.k[0] is device_first[0] and engine.pool.k[0].data_ptr() == device_first[2]
    # what was stored before the growth is still there, unmoved
    assert torch.equal(engine.index.bounds.slabs[0][:used], snap["index.bounds"])
    assert torch.equal(engine.index.codes.slabs[0][:used], snap["index.codes"])
    assert torch.equal(engine.host.k.slabs[0][:host_rows], snap["host.k"])


# ---------------------------------------------------------------------------------------- 5. index on device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 32])
def test_device_index_bytes_are_at_most_a_sixteenth_of_the_demoted_bytes(make_engine, dtype, page_size):
    engine = make_engine(heads=2, head_dim=64, device_budget=0.1, host_budget=0.3, page_size=page_size,
                         sink_tokens=4, recent_tokens=16)
    g = torch.Generator().manual_seed(4)
    for _ in range(6):
        k = torch.randn(1, engine.heads, 700, engine.head_dim, generator=g).to(dtype)
        engine.write(k, k)
        engine.commit()
        demoted = engine.table.n * engine.heads * page_size * 2 * engine.head_dim * k.element_size()
        assert engine.table.n > 0 and (engine.table.tier == DISK).any()
        assert 0 < engine.index_bytes() <= demoted / 16
        assert engine.usage()["device"]["index_bytes"] == engine.index_bytes()
