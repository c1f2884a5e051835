"""The same guarantees on a CUDA machine: GPU device pool, pinned host pool, stream copies."""

from __future__ import annotations

import pytest
import torch

from kvtier.placement.page_table import DISK, HOST

pytestmark = pytest.mark.cuda


def test_stream_copies_are_exact_and_counted(cuda_device):
    from kvtier.transfer.cuda_streams import CudaTransferManager

    manager = CudaTransferManager(cuda_device)
    src = torch.randn(64, 1024, device=cuda_device)
    host = torch.empty(src.shape, pin_memory=True)
    manager.wait([manager.submit(host, src)])
    assert torch.equal(host, src.cpu())
    back = torch.empty_like(src)
    job = manager.submit(back, host)
    manager.wait([job])
    assert torch.equal(back, src)  # the current stream waited on the copy's event
    assert manager.counters.bytes["d2h"] == manager.counters.bytes["h2d"] == src.numel() * 4
    manager.close()


def test_work_run_ahead_waits_for_what_came_before_and_is_waited_for(cuda_device):
    """`run_ahead` starts after the current stream's queued work (held back here by a sleep) and runs on
    another stream; `wait` then orders the current stream after it. Nothing is read back on the way."""
    from kvtier.transfer.cuda_streams import CudaTransferManager

    manager = CudaTransferManager(cuda_device)
    src = torch.zeros(1 << 20, device=cuda_device)
    out = torch.full_like(src, float("nan"))
    torch.cuda._sleep(5_000_000)
    src.fill_(3.0)                         # queued behind the sleep on the current stream
    ran_on = []

    def work():
        ran_on.append(torch.cuda.current_stream(cuda_device))
        torch.cuda._sleep(5_000_000)
        out.copy_(src * 2)

    job = manager.run_ahead(work, uses=[src, out])
    assert ran_on[0] != torch.cuda.current_stream(cuda_device)
    manager.wait([job])
    result = out + 1                       # on the current stream, after the side stream's work
    assert torch.equal(result, torch.full_like(src, 7.0))
    assert manager.done(job)
    manager.close()


def test_read_mark_reuses_one_event_and_waits_for_the_last_read(cuda_device):
    """A `ReadMark` noted twice keeps one event; `synchronize` waits for the read noted last (held back by a
    sleep on a side stream), and `order_before` puts a stream's later work after it."""
    from kvtier.transfer.read_mark import ReadMark

    mark, side = ReadMark(), torch.cuda.Stream(cuda_device)
    host = torch.zeros(1 << 20, pin_memory=True)
    seen = torch.empty(1 << 20, device=cuda_device)
    mark.note(cuda_device)
    first = mark._event
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        seen.copy_(host, non_blocking=True)   # the device reads the pinned memory late
        mark.note(cuda_device)
    assert mark._event is first and mark.pending
    later = torch.cuda.Stream(cuda_device)
    mark.order_before(later)
    with torch.cuda.stream(later):
        after = seen + 1
    mark.synchronize()
    assert not mark.pending and first.query()
    host.fill_(5.0)                           # the read is over: writing the host memory now changes nothing
    later.synchronize()
    assert torch.equal(after, torch.ones_like(after))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_on_gpu_is_bit_exact(make_engine, cuda_device, dtype):
    engine = make_engine(device_budget=16, host_budget=12, page_size=4, recall_pages=10_000)
    g = torch.Generator(device=cuda_device).manual_seed(0)
    k_all = torch.randn(1, engine.heads, 120, engine.head_dim, generator=g, device=cuda_device).to(dtype)
    v_all = torch.randn(1, engine.heads, 120, engine.head_dim, generator=g, device=cuda_device).to(dtype)
    for start in range(0, 120, 7):
        engine.write(k_all[:, :, start:start + 7], v_all[:, :, start:start + 7])
        engine.commit()
    assert engine.pool.k[0].is_cuda and engine.host.k.slabs[0].is_pinned()
    tiers = engine.table.tier
    assert (tiers == HOST).any() and (tiers == DISK).any()
    heads, r = engine.heads, engine.table.n
    ids = torch.arange(r, device=cuda_device).expand(heads, -1)   # page ids where the recall plans: the GPU
    rk, rv, _ = engine._fetch(ids, ids)          # every demoted page, straight to the GPU
    assert rk.is_cuda
    pos, _ = engine.pool.meta()
    for h in range(heads):
        # pages come back as a set (sorted by tier and slot within a head): compare each page's rows
        got = {}
        for i in range(r):
            page = rk[h, i * 4:(i + 1) * 4]
            match = [p for p in range(r) if torch.equal(
                page, k_all[0, h, torch.from_numpy(engine.table.positions(h, p)).to(cuda_device)])]
            assert match, f"head {h}: a recalled page matches no demoted page"
            got[match[0]] = rv[h, i * 4:(i + 1) * 4]
        assert sorted(got) == list(range(r))
        for p, v in got.items():
            assert torch.equal(v, v_all[0, h, torch.from_numpy(engine.table.positions(h, p)).to(cuda_device)])
        held = torch.cat([pos[h].cpu(), torch.from_numpy(
            __import__("numpy").concatenate([engine.table.positions(h, p) for p in range(r)]))])
        assert torch.equal(held.sort().values, torch.arange(120))


@pytest.mark.slow
@torch.no_grad()
def test_default_model_on_gpu(fresh_attention, cuda_device):
    from transformers import DynamicCache

    from kvtier import TieredCache, cache_kwargs

    model, tok = fresh_attention
    model.to(cuda_device)
    try:
        ids = tok.apply_chat_template([{"role": "user", "content": "Tell me about lighthouses. " * 60}],
                                      add_generation_prompt=True, return_tensors="pt")
        ids = (ids if isinstance(ids, torch.Tensor) else ids["input_ids"]).to(cuda_device)
        ref = model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=32,
                             do_sample=False)
        full = TieredCache(model.config, device_budget=1.0)
        assert torch.equal(model.generate(ids, **cache_kwargs(full), max_new_tokens=32, do_sample=False), ref)
        ref_logits = model(ids, **cache_kwargs(DynamicCache(config=model.config))).logits[:, -1]
        # every page recalled, so no page ranks after the choice: no prefetch slots (half of 100,000 by default
        # on CUDA: 34 GiB of recall buffers)
        cache = TieredCache(model.config, device_budget=0.1, host_budget=0.2, recall_pages=100_000, prefetch_pages=0)
        logits = model(ids, **cache_kwargs(cache)).logits[:, -1]
        torch.testing.assert_close(logits, ref_logits)
        nxt = logits.argmax(-1, keepdim=True)
        ref_cache = DynamicCache(config=model.config)
        model(ids, **cache_kwargs(ref_cache))
        torch.testing.assert_close(model(nxt, **cache_kwargs(cache)).logits,
                                   model(nxt, **cache_kwargs(ref_cache)).logits, rtol=1e-4, atol=1e-4)
        s = cache.stats()
        assert s["pages_recalled_from"]["disk"] > 0 and s["host"]["reserved_bytes"] > 0
        cache.close()
    finally:
        model.to("cpu")


def test_kvp_scorer_on_gpu_matches_cpu(cuda_device):
    from kvtier.scoring.kvp import KVPScorer

    scorer = KVPScorer()
    keys = torch.randn(1, 3, 50, 64)
    values = torch.randn(1, 3, 50, 64)
    cpu = scorer.score(keys, values, torch.arange(50), 4)
    gpu = scorer.score(keys.to(cuda_device), values.to(cuda_device), torch.arange(50, device=cuda_device), 4)
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-4)
    assert next(scorer.agents.parameters()).device.type == "cpu"
