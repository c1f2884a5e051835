"""Page bounds really bound q.k (also as the PageIndex keeps them), codes decode within half a step, the
selector finds the pages that matter, and split attention over recalled pages, device slabs and the new
tokens is exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.attention import attend_split
from kvtier.recall import (PageIndex, decode_codes, encode_codes, grouped, page_bounds, page_shares, round_outward,
                           select_pages, upper_bounds)


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


def _make_index(keys, dtype=torch.float32, pages_per_slab=1024):
    """A PageIndex holding ``keys`` ``[heads, pages, page_size, dim]`` (whole pages), added in two calls."""
    heads, pages, page_size, dim = keys.shape
    index = PageIndex(heads, page_size, dim, dtype, torch.device("cpu"), pages_per_slab=pages_per_slab)
    cut = pages // 2
    index.add(keys[:, :cut].to(dtype))
    index.add(keys[:, cut:].to(dtype))
    assert index.n == pages
    return index


def _index(keys):
    lo, hi = page_bounds(keys, torch.full(keys.shape[:2], keys.shape[2]))
    return lo, hi, encode_codes(keys, lo, hi)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), page_size=st.integers(1, 9), slab=st.integers(1, 7),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_page_index_bounds_hold_across_slabs_and_dtypes(seed, page_size, slab, dtype):
    """The index's stored (rounded outward) bounds give, slab by slab, an upper bound on every true logit,
    equal to the plain bound of the same stored keys; `pick` returns the rows of the asked page ids."""
    g = torch.Generator().manual_seed(seed)
    keys = (torch.randn(3, 11, page_size, 16, generator=g) * 3).to(dtype)
    index = _make_index(keys, dtype, pages_per_slab=slab)
    q = torch.randn(3, 4, 16, generator=g)
    ub = index.upper_bounds(q)
    assert ub.shape == (3, 11)
    true = torch.einsum("hqd,hpkd->hqpk", q, keys.float()).amax(dim=(1, 3))
    assert (ub >= true - 1e-4 * true.abs().clamp(min=1)).all()
    lo, hi = round_outward(*page_bounds(keys, torch.full((3, 11), page_size)), dtype)
    torch.testing.assert_close(ub, upper_bounds(q, lo, hi), rtol=1e-5, atol=1e-4)
    ids = torch.tensor([[3, 0, 10], [7, 7, 1], [5, 2, 9]])
    p_lo, p_hi, p_codes = index.pick(ids)
    for h in range(3):
        assert torch.equal(p_lo[h], lo[h, ids[h]]) and torch.equal(p_hi[h], hi[h, ids[h]])
        assert torch.equal(p_codes[h], encode_codes(keys[h, ids[h]], lo[h, ids[h]], hi[h, ids[h]]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_keys_of_another_dtype_are_bounded_outward_in_the_index(dtype):
    """Keys finer than the index's dtype (float32 into a half-precision index): the stored bounds still hold every
    key, rounded outward, and the codes are those of the keys as given."""
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(3, 9, 16, 32, generator=g) * 3
    index = PageIndex(3, 16, 32, dtype, torch.device("cpu"), pages_per_slab=4)
    index.add(keys)
    lo, hi, codes = index.pick(torch.arange(9).expand(3, 9))
    assert lo.dtype == hi.dtype == dtype
    assert (lo.float()[:, :, None] <= keys).all() and (hi.float()[:, :, None] >= keys).all()
    assert torch.equal(codes, encode_codes(keys, lo, hi))


@pytest.mark.parametrize("shortlist", [1, 8])
def test_selector_picks_the_page_holding_the_matching_key(shortlist):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 40, 4, 8, generator=g) * 0.1
    needle = torch.randn(8, generator=g)
    keys[0, 17, 2] = needle * 10
    keys[1, 3, 0] = -needle * 10
    index = _make_index(keys)
    query = torch.stack([needle, needle, -needle, -needle])[None, :, None, :]  # 4 q heads, 2 per kv head
    q = grouped(query, 2)
    assert q.shape == (2, 2, 8)
    chosen, short = select_pages(q, index, 2, 8 ** -0.5, shortlist=shortlist, shortlist_min=0)
    assert 17 in chosen[0].tolist() and 3 in chosen[1].tolist()
    assert chosen.shape == (2, 2)
    assert (chosen[:, 1:] > chosen[:, :-1]).all()  # ascending
    assert short.shape == (2, shortlist * 2)  # the shortlist: `shortlist` times the budget (no floor here)
    for h in range(2):
        assert set(chosen[h].tolist()) <= set(short[h].tolist())
    everything, short_all = select_pages(q, index, 100, 8 ** -0.5)
    assert everything.shape == (2, 40) and torch.equal(everything[0], torch.arange(40))
    assert short_all is everything


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), dim=st.integers(1, 11), page_size=st.integers(1, 6))
def test_codes_round_trip_within_half_a_step(seed, dim, page_size):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 3, page_size, dim, generator=g) * 4
    lo, hi, codes = _index(keys)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 3, page_size, -(-dim // 4))
    err = (decode_codes(codes, lo, hi) - keys).abs()
    step = ((hi - lo) / 3)[:, :, None, :]
    assert (err <= step / 2 + 1e-5).all()


@pytest.mark.parametrize("dim", [16, 64, 128, 10])
def test_every_unpacking_gives_the_same_codes(dim):
    """The CPU's table lookup, the word shifts a GPU takes (in their channel order) and the decoded keys agree."""
    from kvtier.recall.codes import shifted_words, unpacked
    g = torch.Generator().manual_seed(dim)
    keys = torch.randn(2, 5, 16, dim, generator=g)
    lo, hi, codes = _index(keys)
    c, order = unpacked(codes, dim)
    assert order is None and c.shape == (2, 5, 16, dim) and c.dtype == torch.float32
    assert set(c.unique().tolist()) <= {0.0, 1.0, 2.0, 3.0}
    torch.testing.assert_close(lo[:, :, None] + c * ((hi - lo) / 3)[:, :, None], decode_codes(codes, lo, hi))
    assert torch.equal(unpacked(codes[:, 1:4], dim)[0], c[:, 1:4])   # a view of the codes, as the selector's chunks
    if dim % 16 == 0:
        words, order = shifted_words(codes, dim)
        assert torch.equal(words, c.index_select(3, order))


def test_page_shares_are_exact_when_keys_sit_on_code_levels():
    g = torch.Generator().manual_seed(3)
    kv_heads, pages, page_size, dim = 2, 6, 4, 8
    base = torch.randn(kv_heads, pages, 1, dim, generator=g)
    width = torch.rand(kv_heads, pages, 1, dim, generator=g) + 0.1
    levels = torch.randint(0, 4, (kv_heads, pages, page_size, dim), generator=g)
    levels[:, :, 0], levels[:, :, 1] = 0, 3          # every channel reaches both ends of its page
    keys = base + levels * width / 3
    lo, hi, codes = _index(keys)
    q = torch.randn(kv_heads, 5, dim, generator=g)
    resident = [torch.randn(kv_heads, 7, dim, generator=g), torch.randn(kv_heads, 3, dim, generator=g),
                torch.randn(kv_heads, 0, dim)]
    got = page_shares(q, lo, hi, codes, 0.3, resident)
    logits = torch.einsum("hrd,hpkd->hrpk", q, keys) * 0.3
    page_lse = torch.logsumexp(logits, dim=3)
    res = torch.cat(resident, dim=1)
    total = torch.logaddexp(torch.logsumexp(page_lse, dim=2), torch.logsumexp(q @ res.transpose(1, 2) * 0.3, 2))
    torch.testing.assert_close(got, (page_lse - total[..., None]).amax(dim=1), rtol=1e-4, atol=1e-4)
    # without resident keys the pages share all the mass
    alone = torch.logsumexp(page_lse, dim=2)
    torch.testing.assert_close(page_shares(q, lo, hi, codes, 0.3), (page_lse - alone[..., None]).amax(dim=1),
                               rtol=1e-4, atol=1e-4)


def test_bounds_rounded_to_bf16_still_bound_every_key():
    keys = torch.randn(3, 10, 16, 8, generator=torch.Generator().manual_seed(4)) * 7
    lo, hi = round_outward(*page_bounds(keys, torch.full((3, 10), 16)), torch.bfloat16)
    assert lo.dtype == torch.bfloat16
    assert (lo.float()[:, :, None] <= keys).all() and (hi.float()[:, :, None] >= keys).all()


@pytest.mark.parametrize("q_len", [1, 4])
def test_split_attention_equals_full_attention(q_len):
    """Recalled pages (in any order), device slabs (one empty) and the new tokens, merged, equal attention
    over their concatenation with the causal square on the new tokens."""
    g = torch.Generator().manual_seed(1)
    kv_heads, group, dim, old, past = 2, 3, 16, 20, 10
    k_old = torch.randn(kv_heads, old, dim, generator=g)
    v_old = torch.randn(kv_heads, old, dim, generator=g)
    key = torch.randn(1, kv_heads, past + q_len, dim, generator=g)
    value = torch.randn(1, kv_heads, past + q_len, dim, generator=g)
    query = torch.randn(1, kv_heads * group, q_len, dim, generator=g)
    perm = torch.randperm(old, generator=g)  # recalled rows come in page order, not position order
    parts = [(k_old[None, :, perm], v_old[None, :, perm]), (key[:, :, :6], value[:, :, :6]),
             (key[:, :, :0], value[:, :, :0]), (key[:, :, 6:past], value[:, :, 6:past])]
    out = attend_split(query, parts, key[:, :, past:], value[:, :, past:], 0, dim ** -0.5)
    assert out.shape == (1, q_len, kv_heads * group, dim) and out.dtype == query.dtype
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
    lo, hi, codes = _index(keys)
    q = torch.randn(2, 9, 8, generator=g)
    resident = [torch.randn(2, 11, 8, generator=g), torch.randn(2, 5, 8, generator=g)]
    whole = page_shares(q, lo, hi, codes, 0.35, resident)
    monkeypatch.setattr(selector, "_CHUNK_ELEMENTS", 40)  # one page and one row at a time
    torch.testing.assert_close(page_shares(q, lo, hi, codes, 0.35, resident), whole)


def test_index_bounds_are_the_same_in_small_chunks(monkeypatch):
    import kvtier.recall.index as index_mod

    g = torch.Generator().manual_seed(6)
    index = _make_index(torch.randn(2, 30, 4, 8, generator=g), pages_per_slab=7)
    q = torch.randn(2, 13, 8, generator=g)
    whole = index.upper_bounds(q)
    monkeypatch.setattr(index_mod, "_CHUNK_ELEMENTS", 1)  # one query row at a time
    torch.testing.assert_close(index.upper_bounds(q), whole)
