"""Page bounds really bound q.k, codes decode within half a step, the selector finds the pages that matter,
and union attention is exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.attention import attend_union
from kvtier.recall import decode_codes, encode_codes, page_bounds, page_shares, round_outward, select_pages, upper_bounds


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), page_size=st.integers(1, 9), count=st.integers(1, 9))
def test_upper_bound_holds(seed, page_size, count):
    count = min(count, page_size)
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(3, 5, page_size, 16, generator=g) * 3
    counts = torch.full((3, 5), count)
    lo, hi = page_bounds(keys, counts)
    q = torch.randn(3, 4, 16, generator=g)
    ub = upper_bounds(q, lo, hi)  # [3, 5]
    true = torch.einsum("hqd,hpkd->hqpk", q, keys[:, :, :count]).amax(dim=(1, 3))
    assert (ub >= true - 1e-4).all()


def _index(keys, count):
    counts = torch.full(keys.shape[:2], count)
    lo, hi = page_bounds(keys, counts)
    return lo, hi, encode_codes(keys, lo, hi), counts


@pytest.mark.parametrize("shortlist", [1, 8])
def test_selector_picks_the_page_holding_the_matching_key(shortlist):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 40, 4, 8, generator=g) * 0.1
    needle = torch.randn(8, generator=g)
    keys[0, 17, 2] = needle * 10
    keys[1, 3, 0] = -needle * 10
    lo, hi, codes, counts = _index(keys, 4)
    query = torch.stack([needle, needle, -needle, -needle])[None, :, None, :]  # 4 q heads, 2 per kv head
    chosen = select_pages(query, lo, hi, codes, counts, 2, shortlist=shortlist, shortlist_min=0)
    assert 17 in chosen[0].tolist() and 3 in chosen[1].tolist()
    assert chosen.shape == (2, 2)
    assert select_pages(query, lo, hi, codes, counts, 100).shape == (2, 40)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), dim=st.integers(1, 11), page_size=st.integers(1, 6))
def test_codes_round_trip_within_half_a_step(seed, dim, page_size):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 3, page_size, dim, generator=g) * 4
    lo, hi, codes, _ = _index(keys, page_size)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 3, page_size, -(-dim // 4))
    err = (decode_codes(codes, lo, hi) - keys).abs()
    step = ((hi - lo) / 3)[:, :, None, :]
    assert (err <= step / 2 + 1e-5).all()


def test_page_shares_are_exact_when_keys_sit_on_code_levels():
    g = torch.Generator().manual_seed(3)
    kv_heads, pages, page_size, dim = 2, 6, 4, 8
    base = torch.randn(kv_heads, pages, 1, dim, generator=g)
    width = torch.rand(kv_heads, pages, 1, dim, generator=g) + 0.1
    levels = torch.randint(0, 4, (kv_heads, pages, page_size, dim), generator=g)
    levels[:, :, 0], levels[:, :, 1] = 0, 3          # every channel reaches both ends of its page
    keys = base + levels * width / 3
    lo, hi, codes, counts = _index(keys, page_size)
    q = torch.randn(kv_heads, 5, dim, generator=g)
    resident = torch.randn(kv_heads, 7, dim, generator=g)
    got = page_shares(q, lo, hi, codes, counts, 0.3, resident)
    logits = torch.einsum("hrd,hpkd->hrpk", q, keys) * 0.3
    page_lse = torch.logsumexp(logits, dim=3)
    total = torch.logaddexp(torch.logsumexp(page_lse, dim=2), torch.logsumexp(q @ resident.transpose(1, 2) * 0.3, 2))
    torch.testing.assert_close(got, (page_lse - total[..., None]).amax(dim=1), rtol=1e-4, atol=1e-4)


def test_bounds_rounded_to_bf16_still_bound_every_key():
    keys = torch.randn(3, 10, 16, 8, generator=torch.Generator().manual_seed(4)) * 7
    lo, hi = round_outward(*page_bounds(keys, torch.full((3, 10), 16)), torch.bfloat16)
    assert lo.dtype == torch.bfloat16
    assert (lo.float()[:, :, None] <= keys).all() and (hi.float()[:, :, None] >= keys).all()


def test_union_attention_equals_full_attention():
    g = torch.Generator().manual_seed(1)
    kv_heads, group, dim, old, past, q_len = 2, 3, 16, 20, 10, 4
    k_old = torch.randn(kv_heads, old, dim, generator=g)
    v_old = torch.randn(kv_heads, old, dim, generator=g)
    key = torch.randn(1, kv_heads, past + q_len, dim, generator=g)
    value = torch.randn(1, kv_heads, past + q_len, dim, generator=g)
    query = torch.randn(1, kv_heads * group, q_len, dim, generator=g)
    # recalled rows: the old entries plus 4 padding rows marked invalid, in shuffled order
    perm = torch.randperm(old, generator=g)
    rec_k = torch.cat([k_old[:, perm], torch.full((kv_heads, 4, dim), 99.0)], dim=1)
    rec_v = torch.cat([v_old[:, perm], torch.full((kv_heads, 4, dim), 99.0)], dim=1)
    valid = torch.arange(old + 4).expand(kv_heads, -1) < old
    out = attend_union(query, key, value, rec_k, rec_v, valid, scaling=None)
    full_k = torch.cat([k_old[None], key], dim=2).repeat_interleave(group, dim=1)
    full_v = torch.cat([v_old[None], value], dim=2).repeat_interleave(group, dim=1)
    mask = torch.ones(q_len, old + past + q_len, dtype=torch.bool)
    mask[:, old + past:] = torch.tril(torch.ones(q_len, q_len, dtype=torch.bool))
    ref = F.scaled_dot_product_attention(query, full_k, full_v, attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_page_shares_are_the_same_in_small_chunks(monkeypatch):
    import kvtier.recall.selector as selector

    g = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 30, 4, 8, generator=g)
    lo, hi, codes, counts = _index(keys, 4)
    counts[:, -1] = 2                                 # a partly filled last page
    q = torch.randn(2, 9, 8, generator=g)
    resident = torch.randn(2, 11, 8, generator=g)
    whole = page_shares(q, lo, hi, codes, counts, 0.35, resident)
    monkeypatch.setattr(selector, "_CHUNK_ELEMENTS", 40)  # one page and one row at a time
    torch.testing.assert_close(page_shares(q, lo, hi, codes, counts, 0.35, resident), whole)
