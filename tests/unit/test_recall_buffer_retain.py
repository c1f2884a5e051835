"""A recall buffer that keeps pages after a step stops choosing them (`retain_pages`, recall planned on the host):
the chosen pages are the ones read (the others masked out), a page kept is found again instead of fetched, the
longest unchosen give way first, and the cache's output is the plain buffer's within rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.recall.buffer import RecallBuffer

from engine_steps import drifting_queries, step_all

H, P, D = 2, 2, 3


def page_data(heads, pids):
    """A page's keys tell which page it is: every entry is ``head * 1000 + pid``."""
    vals = torch.as_tensor(heads * 1000 + pids, dtype=torch.float32)
    return vals[:, None, None].expand(len(heads), P, D).clone()


@st.composite
def choices(draw):
    n = draw(st.integers(4, 12))
    r = draw(st.integers(1, n - 1))
    retain = draw(st.integers(1, 6))
    steps = draw(st.lists(st.lists(st.permutations(range(n)), min_size=H, max_size=H), min_size=1, max_size=12))
    return r, retain, [np.array([np.sort(p[:r]) for p in step]) for step in steps]


@settings(max_examples=200, deadline=None)
@given(choices())
def test_the_chosen_pages_are_read_and_kept_pages_are_not_fetched_again(case):
    r, retain, steps = case
    buf = RecallBuffer(H, r + retain, P, D, torch.float32, torch.device("cpu"), retain=retain)
    last = [dict() for _ in range(H)]   # every page ever chosen -> the step it was last chosen at
    for t, want in enumerate(steps, 1):
        before = [set(buf.ids[h][buf.ids[h] >= 0].tolist()) for h in range(H)]
        free_before = buf._last.copy()   # the step each slot's page was last chosen at (-1: empty)
        heads, pids, slots = buf.plan(want)
        # exactly the wanted pages held nowhere are fetched, once each
        expect = sorted((h, int(p)) for h in range(H) for p in want[h] if int(p) not in before[h])
        assert sorted(zip(heads.tolist(), pids.tolist())) == expect
        buf.fill(heads, pids, slots, page_data(heads, pids), page_data(heads, pids) + 0.5)
        for h in range(H):
            # a page brought up takes a slot whose page is not wanted, unchosen longest (empty ones first)
            mine = slots[heads == h]
            chosen_now = set(want[h].tolist())
            others = [s for s in range(buf.pages) if s not in set(mine.tolist())
                      and (buf.ids[h, s] < 0 or int(buf.ids[h, s]) not in chosen_now)]
            if len(mine) and others:
                assert free_before[h, mine].max() <= free_before[h, others].min()
            for p in want[h].tolist():
                last[h][p] = t
            # the buffer holds the chosen pages and, of the others, those chosen most lately (ties either way)
            held = set(buf.ids[h][buf.ids[h] >= 0].tolist())
            assert chosen_now <= held <= set(last[h]) and len(held) == min(buf.pages, len(last[h]))
            dropped = set(last[h]) - held
            if dropped and held - chosen_now:
                assert min(last[h][p] for p in held - chosen_now) >= max(last[h][p] for p in dropped)
        # every slot holds the page its id names; the mask lets through exactly the chosen slots
        ok = buf.ids >= 0
        rows = buf.k.view(H, buf.pages, P, D)[..., 0, 0]
        assert torch.equal(rows[torch.from_numpy(ok)], torch.from_numpy((np.arange(H)[:, None] * 1000 + buf.ids)[ok])
                           .float())
        seen = (buf.mask.view(H, buf.pages, P)[..., 0] == 0).numpy()
        assert (buf.mask.view(H, buf.pages, P) == buf.mask.view(H, buf.pages, P)[..., :1]).all()
        for h in range(H):
            assert sorted(buf.ids[h][seen[h]].tolist()) == want[h].tolist()
        keys, ids = buf.chosen_pages()
        for h in range(H):
            assert sorted(ids[h].tolist()) == want[h].tolist()
            assert torch.equal(keys[h].view(-1, P, D)[:, 0, 0], torch.from_numpy(h * 1000 + ids[h]).float())


def test_a_buffer_that_retains_is_planned_on_the_host_and_keeps_fewer_slots_than_it_has():
    for bad in ({"retain": 4, "on_device": True}, {"retain": 6}, {"retain": 9}):
        with pytest.raises(ValueError, match="retain="):
            RecallBuffer(H, 6, P, D, torch.float32, torch.device("cpu"), **bad)


@pytest.mark.parametrize("bad", [-1, 1.5, "4", None])
def test_a_bad_retain_pages_names_the_value(bad):
    from kvtier import TieredCache

    with pytest.raises(ConfigError, match=r"retain_pages=.*allowed: a whole number >= 0"):
        TieredCache(_model().config, device_budget=40, retain_pages=bad)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                                        attn_implementation="eager")).eval()


def _drift(make_engine, retain_pages, steps=60, **kw):
    g = torch.Generator().manual_seed(5)
    e = make_engine(heads=2, head_dim=16, device_budget=24, recall_pages=4, page_size=4, retain_pages=retain_pages,
                    **kw)
    for _ in range(80):
        step_all([e], torch.randn(1, 2, 1, 16, generator=g))
    outs, choices = [], []
    for q in drifting_queries(g, steps, keep=0.7, noise=0.7):
        outs.append(step_all([e], torch.randn(1, 2, 1, 16, generator=g), q)[0])
        choices.append(e.last_recall.clone())
    return e, outs, choices


@pytest.mark.parametrize("host_budget", [None, 8])
def test_keeping_pages_reads_fewer_and_attends_as_the_plain_buffer(make_engine, host_budget):
    plain, out0, ch0 = _drift(make_engine, 0, host_budget=host_budget)
    kept, out1, ch1 = _drift(make_engine, 4, host_budget=host_budget)
    assert kept.recalled.retain == 4 and plain.recalled.retain == 0
    for a, b, c, d in zip(out0, out1, ch0, ch1):
        assert torch.equal(c, d)   # the same choice every step
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    moved = [sum(e.counters.pages_recalled.values()) for e in (plain, kept)]
    assert moved[1] < moved[0]
    if host_budget is not None:
        assert kept.counters.pages_recalled["disk"] < plain.counters.pages_recalled["disk"]
    reused = [e.counters.pages_reused for e in (plain, kept)]
    assert reused[1] - reused[0] == moved[0] - moved[1]


@torch.no_grad()
def test_a_cache_that_keeps_pages_decodes_as_one_that_does_not(tmp_path):
    """The same greedy tokens, logits and eager weights within rounding, with pages on disk too; fewer pages
    brought up; and the setting survives a copy of the cache."""
    import copy

    from kvtier import TieredCache, cache_kwargs

    model = _model()
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    runs = []
    for retain in (0, 3):
        with TieredCache(model.config, device_budget=40, host_budget=48, recall_pages=3, page_size=4,
                         retain_pages=retain, scorer="keynorm", disk_dir=tmp_path) as cache:
            model(ids, **cache_kwargs(cache))
            token, tokens, steps = torch.tensor([[5]]), [], []
            for _ in range(16):
                out = model(token, output_attentions=True, **cache_kwargs(cache))
                token = out.logits[:, -1:].argmax(-1)
                tokens.append(int(token))
                steps.append((out.logits, out.attentions))
            runs.append((tokens, steps, cache.stats()))
            assert copy.deepcopy(cache).settings.retain_pages == retain
    (tokens, steps, plain), (tokens_kept, steps_kept, kept) = runs
    assert tokens == tokens_kept
    for (logits, maps), (logits_kept, maps_kept) in zip(steps, steps_kept):
        torch.testing.assert_close(logits_kept, logits, rtol=1e-5, atol=1e-5)
        for a, b in zip(maps, maps_kept):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert kept["pages_recalled"] < plain["pages_recalled"] and kept["pages_recalled_from"]["disk"] > 0
    assert kept["pages_reused"] > plain["pages_reused"]


@pytest.mark.parametrize("dtype, softcap", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 30.0),
                                            (torch.float64, None)])
def test_masked_attention_is_attention_over_the_keys_let_through(dtype, softcap):
    """`attend_with_lse` with a recall buffer's mask: the fused CPU kernel, and the float32 path (soft-capped
    logits, other dtypes), give the attention over the unmasked keys alone."""
    from kvtier.engine.attention import attend_with_lse

    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 3, 8, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 24, 8, generator=g).to(dtype) for _ in range(2))
    keep = torch.rand(2, 24, generator=g) < 0.5
    keep[:, 0] = True
    mask = torch.zeros(1, 2, 1, 24, dtype=dtype).masked_fill_(~keep[None, :, None], float("-inf"))
    out, lse = attend_with_lse(q, k, v, 0.3, softcap=softcap, mask=mask)
    for h in range(2):
        o, s = attend_with_lse(q[:, h:h + 1], k[:, h:h + 1, keep[h]], v[:, h:h + 1, keep[h]], 0.3, softcap=softcap)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[:, h:h + 1], o, rtol=tol, atol=tol)
        torch.testing.assert_close(lse[:, h:h + 1], s, rtol=tol, atol=tol)


@pytest.mark.parametrize("retain_pages", [0, 2])
def test_a_step_whose_pages_could_not_be_read_is_tried_again_as_if_never_planned(make_engine, retain_pages,
                                                                               monkeypatch):
    """A disk read fails at one step's attention, and the step is attended again: the same bits as a twin that met
    no failure, then and at every later step, and the same counters. A retaining buffer had kept the failed
    plan's ages (its later steps placed pages in other slots, summing in another order), and the pages the
    failed step would have reused were counted twice."""
    from kvtier.errors import CorruptPageError

    kw = dict(heads=2, head_dim=16, device_budget=32, host_budget=24, recall_pages=4, page_size=4, read_ahead=False,
              retain_pages=retain_pages)
    clean, failed = make_engine(**kw), make_engine(**kw)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 200, 16, generator=g)
    step_all([clean, failed], k)
    for s in range(12):
        k, q = torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 4, 1, 16, generator=g)
        outs = []
        for e in (clean, failed):
            e.write(k, k.flip(-1))
            if e is failed and s == 5:
                def unreadable(slots, out):
                    raise CorruptPageError("the disk could not be read")

                monkeypatch.setattr(e, "_load_disk", unreadable)
                with pytest.raises(CorruptPageError):
                    e.attend(q)
                monkeypatch.undo()
            outs.append(e.attend(q)[0])
            e.commit()
        assert torch.equal(*outs), s
    assert np.array_equal(clean.recalled.ids, failed.recalled.ids)
    for name in ("pages_reused", "recall_steps", "pages_recalled"):
        assert getattr(clean.counters, name) == getattr(failed.counters, name), name


def test_a_fill_cut_short_leaves_no_slot_passing_for_its_old_page(monkeypatch):
    """The keys written, the values not: the slots hold parts of new pages, so they are empty now, never their old
    pages (whose ids they still carried)."""
    import kvtier.recall.buffer as buffer_module

    buf = RecallBuffer(H, 2, P, D, torch.float32, torch.device("cpu"))
    heads, pids, slots = buf.plan(np.array([[0, 1], [2, 3]]))
    buf.fill(heads, pids, slots, page_data(heads, pids), page_data(heads, pids))
    heads, pids, slots = buf.plan(np.array([[0, 5], [2, 7]]))
    real, calls = buffer_module.native.scatter_pages, []

    def keys_only(*args):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError
        return real(*args)

    monkeypatch.setattr(buffer_module.native, "scatter_pages", keys_only)
    with pytest.raises(MemoryError):
        buf.fill(heads, pids, slots, page_data(heads, pids), page_data(heads, pids))
    assert (buf.ids[heads, slots] == -1).all()
    assert sorted(buf.ids[buf.ids >= 0].tolist()) == [0, 2]   # the slots the fill did not touch
