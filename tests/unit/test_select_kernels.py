"""Page choice through the native kernels (`page_upper_bounds`, then `rank_pages`, or `code_logits` where the
short list is too long for one block; what a CUDA device runs, one launch each) against the matrix products a
CPU runs: the same estimates up to float rounding, the same pages chosen, the same attention. Forced here on
the CPU, where the kernels' twins give the kernels' bits."""

from __future__ import annotations

import torch

from kvtier import native
from kvtier.recall.index import PageIndex
from kvtier.recall.selector import page_shares, select_pages


def _index(g, heads=2, pages=40, page_size=16, dim=64, dtype=torch.float32) -> PageIndex:
    index = PageIndex(heads, page_size, dim, dtype, torch.device("cpu"), pages_per_slab=16)
    # pages of keys around different centres, so pages differ as a model's do
    centres = torch.randn(heads, pages, 1, dim, generator=g) * 2
    index.add(centres + torch.randn(heads, pages, page_size, dim, generator=g))
    return index


def test_bounds_and_shares_agree_with_the_matrix_products():
    g = torch.Generator().manual_seed(0)
    index = _index(g)
    q = torch.randn(2, 3, 64, generator=g)
    plain = index.upper_bounds(q)
    index.native_select = True
    assert index.uses_kernels
    torch.testing.assert_close(index.upper_bounds(q), plain, rtol=1e-5, atol=1e-4)
    ids = torch.stack([torch.randperm(40, generator=g)[:12] for _ in range(2)])
    lo, hi, codes = index.pick(ids)
    resident = torch.randn(2, 3, generator=g) + 5
    a = page_shares(q, lo, hi, codes, 0.125, resident_lse=resident)
    b = page_shares(q, lo, hi, codes, 0.125, resident_lse=resident, kernels=True)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_the_same_pages_are_chosen_either_way():
    g = torch.Generator().manual_seed(1)
    index = _index(g, pages=200)
    for _ in range(10):
        q = torch.randn(2, 4, 64, generator=g)
        index.native_select = False
        chosen, ranked = select_pages(q, index, 16, 0.125)
        index.native_select = True
        got, got_ranked = select_pages(q, index, 16, 0.125)
        assert torch.equal(got, chosen)
        assert torch.equal(got_ranked[:, :16].sort(dim=1).values, ranked[:, :16].sort(dim=1).values)


def test_an_engine_choosing_by_kernels_attends_as_the_plain_one(make_engine):
    """Through demotions and 40 decode steps, both ways recall the same pages and their outputs agree up to
    float rounding."""
    engines = [make_engine(heads=2, head_dim=16, device_budget=48, recall_pages=6, page_size=4) for _ in range(2)]
    engines[1].select_kernels = True
    g = torch.Generator().manual_seed(2)
    k = torch.randn(1, 2, 600, 16, generator=g)    # 138 pages: more than the short list's 96
    for e in engines:
        e.write(k, k.flip(-1))
        e.commit()
    assert engines[1].index.uses_kernels and not engines[0].index.uses_kernels
    native.reset_stats()
    for s in range(40):
        k = torch.randn(1, 2, 1, 16, generator=g)
        q = torch.randn(1, 4, 1, 16, generator=g)
        outs = []
        for e in engines:
            e.write(k, k.flip(-1))
            outs.append(e.attend(q)[0])
            e.commit()
        assert torch.equal(engines[0].last_recall, engines[1].last_recall), f"step {s}"
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    ran = native.backend()["ops"]
    assert ran["page_upper_bounds"]["twin"] >= 40 and ran["rank_pages"]["twin"] >= 40   # one engine's steps
    assert "code_logits" not in ran   # the short list fits one block



def test_ranking_in_one_launch_gives_the_shares_of_the_code_logits_path():
    """`rank_pages` estimates what `page_shares` (through `code_logits`) does, up to its own exp and log, and
    ranks as a stable descending sort of its shares."""
    g = torch.Generator().manual_seed(3)
    index = _index(g, pages=120)
    index.native_select = True
    for rows in (1, 3, 8):
        q = torch.randn(2, rows, 64, generator=g)
        cand = torch.stack([torch.randperm(120, generator=g)[:50] for _ in range(2)])
        resident = torch.randn(2, rows, generator=g) + 4
        chosen, ranked, shares = native.rank_pages(q, cand, index.n, (index.bounds.slabs, index.bounds.rows_per_slab),
                                                   (index.codes.slabs, index.codes.rows_per_slab), 16, 0.125, 20,
                                                   resident)
        lo, hi, codes = index.pick(cand)
        want = page_shares(q, lo, hi, codes, 0.125, resident_lse=resident, kernels=True)
        torch.testing.assert_close(shares, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(ranked, cand.gather(1, shares.sort(dim=1, descending=True, stable=True).indices))
        assert torch.equal(chosen, ranked[:, :20].sort(dim=1).values)


def test_a_short_list_too_long_for_one_block_is_ranked_through_code_logits(monkeypatch):
    g = torch.Generator().manual_seed(4)
    index = _index(g, pages=200)
    index.native_select = True
    q = torch.randn(2, 4, 64, generator=g)
    native.reset_stats()
    chosen, ranked = select_pages(q, index, 16, 0.125)
    assert set(native.backend()["ops"]) == {"page_upper_bounds", "rank_pages"}
    monkeypatch.setattr(native, "rank_pages_tile", lambda *a: 0)
    native.reset_stats()
    got, got_ranked = select_pages(q, index, 16, 0.125)
    ran = native.backend()["ops"]
    assert "code_logits" in ran and "rank_pages" not in ran
    assert torch.equal(got, chosen)
    assert torch.equal(got_ranked[:, :16].sort(dim=1).values, ranked[:, :16].sort(dim=1).values)
