"""A decode step's attention over the device pool, one layer: the one-pass kernel (`kvtier.native.attend_slabs`,
the pool in chunks that fill the GPU, then their combine), read narrow and `wide`, against the per-slab path it
replaced (an attention call per slab of the pool, each only a block per KV head on a GPU, and their merge),
side by side on the same pool at each context's device budget: as the host issues the calls, and on CUDA as a
graph of them replays (the device's own time, without the host's launch gaps).
"""

from __future__ import annotations

from typing import Any

import torch

from ... import native
from ...engine.attention import attend_parts, merge_with_lse
from ...engine.graphs import capture_into
from ...engine.layer import SLAB_TOKENS
from ...placement.budget import Budget
from ...tiers.device import DevicePool
from .model import SHAPES
from .settings import GpuBenchConfig
from .timing import Clock, _median, _r

CALLS = 20   # calls a timing, several timings a row
TWIN_CALLS = 1   # where the kernels do not run: the twin follows the kernel's float order op by op (seconds a call
                 # at 1M on a CPU), and its time is no claim about the kernel's


def _pool(H: int, D: int, entries: int, device: torch.device, seed: int) -> DevicePool:
    """A pool of `entries` random bf16 keys and values in the engine's slabs, the last one part-filled."""
    pool = DevicePool(H, D, torch.bfloat16, device, SLAB_TOKENS)
    g = torch.Generator(device=device).manual_seed(seed)
    pool.ensure(entries)
    for start in range(0, entries, SLAB_TOKENS):
        n = min(SLAB_TOKENS, entries - start)
        k = torch.randn(1, H, n, D, generator=g, device=device).to(torch.bfloat16)
        v = torch.randn(1, H, n, D, generator=g, device=device).to(torch.bfloat16)
        pool._write(start, k, v, torch.zeros(H, n, dtype=torch.int64, device=device))
    return pool


def measure_pool_attention(cfg: GpuBenchConfig, device: torch.device, clock: Clock,
                           contexts: list[int]) -> dict[str, Any]:
    """Per context: milliseconds of one layer's pool attention each way (median of `cfg.repeats` timings of
    `CALLS` calls), their ratio, and how far apart the two outputs are."""
    shape = SHAPES[cfg.shape]
    H, D = shape["num_key_value_heads"], shape["head_dim"]
    group = shape["num_attention_heads"] // H
    kernels = device.type == "cuda" and native.kernel_status() is None
    rows = [_row(cfg, device, clock, context, H, D, group, kernels) for context in contexts]
    return {"rows": rows, "kv_heads": H, "query_rows_per_head": group, "head_dim": D,
            "calls_per_timing": CALLS if kernels else TWIN_CALLS,
            "method": "one layer's decode-step attention over a device pool of random bf16 entries (the context's "
                      "device budget plus the step's token, in slabs of 4,096), timed on the device: "
                      "native.attend_slabs (one_pass; one_pass_wide with wide=True) against an attention call per "
                      "slab and merge_with_lse (per_slab, the engine's path before attend_slabs); median of the "
                      "repeats of calls issued by the host (*_ms) and, on CUDA, of a graph of the same calls "
                      "replayed (replayed_ms: the device's time). max_abs_diff: between one_pass and per_slab, the "
                      "per-slab one rounded to bf16 by its attention calls; wide_same_bits: one_pass_wide's output "
                      "bit for bit one_pass's"}


def _row(cfg: GpuBenchConfig, device: torch.device, clock: Clock, context: int, H: int, D: int, group: int,
         kernels: bool) -> dict[str, Any]:
    """One context's pool, timed both ways (the pool is freed on return)."""
    scale = D ** -0.5
    # what a cache of `context` tokens holds on the device (a token-count budget may exceed the context), with
    # the step's own token
    entries = min(context, Budget(cfg.device_budget, "device_budget").tokens(context)) + 1
    pool = _pool(H, D, entries, device, cfg.seed)
    g = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    q = torch.randn(1, H * group, 1, D, generator=g, device=device).to(torch.bfloat16)
    packed = q.reshape(H, group, D)
    addresses = pool.addresses()

    def one_pass():
        return native.attend_slabs(packed, pool.k, pool.v, entries, scale, addresses=addresses, wide=False)

    def one_pass_wide():
        return native.attend_slabs(packed, pool.k, pool.v, entries, scale, addresses=addresses, wide=True)

    def per_slab():
        return merge_with_lse(attend_parts(q, pool.spans(entries), None, None, 0, scale), kernels=kernels)

    def timed(fn) -> float:
        fn()
        calls = CALLS if kernels else TWIN_CALLS
        return _median([clock.time(lambda: [fn() for _ in range(calls)]) / calls for _ in range(cfg.repeats)]) * 1e3

    def replayed(fn) -> float | str:
        """ms a call, `CALLS` calls captured in one CUDA graph and replayed; why not, where it could not be."""
        if not kernels:
            return "no graph: the kernels do not run here"
        side, graph = torch.cuda.Stream(device), torch.cuda.CUDAGraph()
        try:
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                fn()   # warm on the capturing stream
                # captured as the engine does (not `torch.cuda.graph`, which stays on its stream and leaves the
                # capture's pool and the random generator as they were in the capture when `capture_end` fails)
                capture_into(graph, device, torch.cuda.graph_pool_handle(), lambda: [fn() for _ in range(CALLS)])
            torch.cuda.current_stream(device).wait_stream(side)
            graph.replay()
            ms = _median([clock.time(graph.replay) / CALLS for _ in range(cfg.repeats)]) * 1e3
            del graph
            return ms
        except RuntimeError as e:   # a capture refused: said, not hidden
            torch.cuda.current_stream(device).wait_stream(side)
            return f"no graph: {' '.join(str(e).split())[:200]}"

    before = native.backend()["ops"].get("attend_slabs", {}).get("kernel", 0)
    one_ms, wide_ms, slab_ms = timed(one_pass), timed(one_pass_wide), timed(per_slab)
    ran_kernel = native.backend()["ops"].get("attend_slabs", {}).get("kernel", 0) > before
    graphs = {name: replayed(fn) for name, fn in (("one_pass", one_pass), ("one_pass_wide", one_pass_wide),
                                                   ("per_slab", per_slab))}
    a, w, b = one_pass(), one_pass_wide(), per_slab()
    return {"context": context, "entries": entries, "slabs": len(pool.k),
            "chunk": native.attend_chunk(entries, H, device=device),
            "one_pass_ms": _r(one_ms, 4), "one_pass_wide_ms": _r(wide_ms, 4), "per_slab_ms": _r(slab_ms, 4),
            "per_slab_over_one_pass": _r(slab_ms / one_ms, 2) if one_ms > 0 else None,
            "replayed_ms": {name: _r(v, 4) if isinstance(v, float) else v for name, v in graphs.items()},
            "one_pass_path": "kernel" if ran_kernel else "twin",
            "wide_same_bits": bool(torch.equal(a[0], w[0]) and torch.equal(a[1], w[1])),
            "max_abs_diff": _r(float((a[0] - b[0][0]).abs().max()), 8)}
