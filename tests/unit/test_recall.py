"""Page bounds really bound q.k, the selector keeps the best pages, and union attention is exact."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.attention import attend_union
from kvtier.recall import page_bounds, select_pages, upper_bounds


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


def test_selector_picks_the_page_holding_the_matching_key():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 40, 4, 8, generator=g) * 0.1
    needle = torch.randn(8, generator=g)
    keys[0, 17, 2] = needle * 10
    keys[1, 3, 0] = -needle * 10
    lo, hi = page_bounds(keys, torch.full((2, 40), 4))
    query = torch.stack([needle, needle, -needle, -needle])[None, :, None, :]  # 4 q heads, 2 per kv head
    chosen = select_pages(query, lo, hi, 2)
    assert 17 in chosen[0].tolist() and 3 in chosen[1].tolist()
    assert chosen.shape == (2, 2)
    assert select_pages(query, lo, hi, 100).shape == (2, 40)


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
