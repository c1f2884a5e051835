"""Attention-based baselines: what they compute, and that they refuse to run without the query."""

from __future__ import annotations

import pytest
import torch

from kvtier import ScorerError, make_scorer
from kvtier.scoring import checked_scores


def _attention(query, keys, scaling):
    """Plain causal attention, new keys last: [kv_heads, group, q, n]."""
    kv, n = keys.shape[1], keys.shape[2]
    q_len = query.shape[2]
    q = query[0].reshape(kv, -1, q_len, query.shape[3])
    logits = torch.einsum("hgqd,hkd->hgqk", q, keys[0]) * scaling
    future = torch.arange(n)[None, :] - (n - q_len) > torch.arange(q_len)[:, None]
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)


@pytest.fixture
def step():
    g = torch.Generator().manual_seed(0)
    old, new = 7, 40
    context = torch.randn(1, 2, old + new, 8, generator=g)
    query = torch.randn(1, 6, new, 8, generator=g)
    return context[:, :, old:], context, query, new


def test_tova_h2o_snapkv_match_their_definitions(step):
    keys, context, query, new = step
    att = _attention(query, context, 0.3)[..., -new:]
    kw = dict(query=query, context_keys=context, scaling=0.3)
    pos = torch.arange(new)
    tova = checked_scores(make_scorer("tova"), keys, keys, pos, 0, **kw)
    torch.testing.assert_close(tova[0], att[:, :, -1].mean(1))
    h2o = checked_scores(make_scorer("h2o"), keys, keys, pos, 0, **kw)
    torch.testing.assert_close(h2o[0], att.sum(2).mean(1))
    snap = checked_scores(make_scorer("snapkv", window=8, kernel=1), keys, keys, pos, 0, **kw)
    torch.testing.assert_close(snap[0], att[:, :, -8:].sum(2).mean(1))


def test_chunking_does_not_change_h2o(step):
    from kvtier.scoring.attention_stats import received_attention

    keys, context, query, new = step
    a = received_attention(query, context, new, 0.3, chunk=7)
    b = received_attention(query, context, new, 0.3, chunk=1000)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("chunk", [1, 7, 40, 1000])
@pytest.mark.parametrize("rows", [slice(None), slice(-1, None), slice(-9, None), slice(13, None), slice(5, 31)])
def test_chunks_read_only_visible_keys_and_match_plain_attention(step, chunk, rows):
    """Each chunk leaves out the keys its last query cannot see and masks only its diagonal block; the rows
    and their sum must still equal plain causal attention."""
    from kvtier.scoring.attention_stats import received_attention, received_attention_sum

    _, context, query, new = step
    plain = _attention(query, context, 0.3)[:, :, rows]
    got = received_attention(query, context, new, 0.3, rows, chunk=chunk)
    torch.testing.assert_close(got, plain[..., -new:])
    torch.testing.assert_close(received_attention_sum(query, context, new, 0.3, rows, chunk=chunk),
                               plain[..., -new:].sum(2))


def test_strided_query_rows_and_fewer_new_keys_than_queries_are_refused(step):
    from kvtier.scoring.attention_stats import received_attention, received_attention_sum

    _, context, query, new = step
    with pytest.raises(ValueError, match="contiguous slice; got step 2"):
        received_attention(query, context, new, 0.3, slice(None, None, 2))
    for fn in (received_attention, received_attention_sum):
        with pytest.raises(ValueError, match=r"new=10 with 40 queries and 47 keys; allowed: from the number of "):
            fn(query, context, 10, 0.3)


def test_query_needing_scorer_without_query_is_an_error(make_engine):
    engine = make_engine(scorer="tova", device_budget=8, sink_tokens=1, recent_tokens=2)
    k = torch.randn(1, engine.heads, 20, engine.head_dim)
    engine.write(k, k)
    with pytest.raises(ScorerError, match="needs the attention query"):
        engine.commit()
    assert engine.pending is not None  # nothing was lost; it can still be placed with the query
    engine.commit(query=torch.randn(1, engine.heads * 2, 20, engine.head_dim))
    assert engine.pending is None
    assert engine.pool.count <= 8 and engine.table.n > 0
    # nothing was lost: the device and the (whole) demoted pages hold every position once
    pos, _ = engine.pool.meta()
    for h in range(engine.heads):
        pages = [engine.table.positions(h, p) for p in range(engine.table.n)]
        held = sorted(pos[h].tolist() + [int(x) for page in pages for x in page])
        assert held == list(range(20))


def test_chunks_fit_the_memory_budget_of_their_device():
    """16 MiB of logits on the CPU (larger blocks cost kernel time on every chunk), more on an accelerator."""
    from kvtier.scoring.attention_stats import CHUNK_BYTES, DEVICE_CHUNK_BYTES, chunk_rows

    rows = chunk_rows(9, 7680)
    assert rows * 9 * 7680 * 4 <= CHUNK_BYTES < (rows + 1) * 9 * 7680 * 4
    assert chunk_rows(32, 131072, "cuda") * 32 * 131072 * 4 <= DEVICE_CHUNK_BYTES
    assert chunk_rows(32, 131072, "cuda") > chunk_rows(32, 131072) == 1
    assert chunk_rows(9, 100) == chunk_rows(9, 100, "cuda") == 512


@pytest.mark.parametrize("scorer", ["tova", "h2o"])
def test_left_padding_takes_no_share_of_the_scores_attention(scorer):
    """The scorers' softmax ran over the padding keys too, which the model never attends: TOVA's scores of the
    real tokens summed to 0.75 with 10 padding tokens before 30."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvtier import TieredCache, cache_kwargs

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=128, attn_implementation="eager", pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    pad, real = 10, 30
    ids = torch.cat([torch.zeros(1, pad, dtype=torch.long),
                     torch.randint(1, 128, (1, real), generator=torch.Generator().manual_seed(1))], 1)
    mask = (ids != 0).long()
    with torch.no_grad(), TieredCache(cfg, scorer=scorer, device_budget=1.0) as cache:
        attentions = model(ids, attention_mask=mask, output_attentions=True).attentions
        model(ids, attention_mask=mask, **cache_kwargs(cache))
        for layer, engine in enumerate(cache._engines):
            pos, score = engine.pool.meta()
            assert pos.shape[1] == real
            probs = attentions[layer][0].reshape(2, 2, pad + real, pad + real).mean(1)   # [kv heads, query, key]
            # the model's attention to each entry kept: the last query's (TOVA), every query's summed (H2O)
            want = probs[:, -1] if scorer == "tova" else probs[:, pad:].sum(1)
            assert torch.allclose(torch.gather(want, 1, pos), score, atol=1e-6), (layer, scorer)
