"""What kvtier's own Python costs the host per native kernel call, on any machine.

On a GPU a decode step issues some ten native kernel calls a layer (`kvtier bench launches`); each costs the
host its wrapper's checks, allocations and argument building, then cupy's launch. The first part is
kvtier's code and can be timed anywhere: under `kvtier.native.loader.dry_run` every operation takes its
kernel path on this machine's tensors and builds its launch, but nothing is launched. Timed at the shapes of
a decode step of the Llama-3.1-8B shape (8 KV heads of 128 channels, 4 query rows each, bf16) with 10% of the
context on the device, next to a torch operation timed in the same run. cupy's own launch cost, and the
whole call on a GPU, are `kvtier bench gpu`'s (`launch_cost`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import native
from ..native import loader

HEADS, ROWS, DIM, PAGE = 8, 4, 128, 16
SLAB_TOKENS = 4096          # the device pool's slab (engine/layer.py)
HOST_SLAB_BYTES = 4 << 20   # a host storage's slab (tiers/host.py)
INDEX_PAGES_PER_SLAB = 1024  # the recall index's slab (recall/index.py)
RECALL_PAGES, BUFFER_PAGES, SHORTLIST = 64, 96, 96
# calls per layer and decode step, as `kvtier bench launches` counts them on the GPU's path
CALLS = {"plan_recall": 2, "recall_pages": 2, "page_upper_bounds": 1, "rank_pages": 1, "kvp_score": 1,
         "attend_slabs": 1, "attend_pages": 1}


@dataclass
class _Step:
    """The tensors one layer's decode step hands the native operations at `context` tokens."""

    context: int
    budget: float

    def __post_init__(self) -> None:
        bf16, i64 = torch.bfloat16, torch.int64
        H, D = HEADS, DIM
        self.entries = max(1, int(self.context * self.budget))
        self.pages = max(SHORTLIST, (self.context - self.entries) // PAGE)
        pool_slabs = -(-(self.entries + 1) // SLAB_TOKENS)
        self.pool_k = [torch.empty(1, H, SLAB_TOKENS, D, dtype=bf16) for _ in range(pool_slabs)]
        self.pool_v = [torch.empty(1, H, SLAB_TOKENS, D, dtype=bf16) for _ in range(pool_slabs)]
        self.pool_addr = (torch.zeros(pool_slabs, dtype=i64), torch.zeros(pool_slabs, dtype=i64))
        row_bytes = PAGE * D * 2
        self.host_per = HOST_SLAB_BYTES // row_bytes
        host_slabs = -(-self.pages * H // self.host_per)   # untouched: the memory is never committed
        self.host_k = [torch.empty(self.host_per, PAGE, D, dtype=bf16) for _ in range(host_slabs)]
        self.host_v = [torch.empty(self.host_per, PAGE, D, dtype=bf16) for _ in range(host_slabs)]
        self.host_addr = torch.zeros(host_slabs, dtype=i64)
        self.buf_k = torch.empty(H, BUFFER_PAGES * PAGE, D, dtype=bf16)   # the recall buffer
        self.buf_v = torch.empty_like(self.buf_k)
        index_slabs = -(-self.pages // INDEX_PAGES_PER_SLAB)
        self.index_per = INDEX_PAGES_PER_SLAB * H
        self.bounds = [torch.empty(self.index_per, 2 * D, dtype=bf16) for _ in range(index_slabs)]
        self.codes = [torch.empty(self.index_per, PAGE, D // 4, dtype=torch.uint8) for _ in range(index_slabs)]
        self.index_addr = torch.zeros(index_slabs, dtype=i64)
        self.q = torch.zeros(H, ROWS, D, dtype=bf16)
        self.at = torch.zeros(1, dtype=i64)
        self.qf = torch.zeros(H, ROWS, D)
        self.want = torch.zeros(H, RECALL_PAGES, dtype=i64)
        self.held = torch.zeros(H, BUFFER_PAGES, dtype=i64)
        self.host_slots = torch.zeros(H, self.pages, dtype=i64)
        self.ahead = torch.zeros(H, BUFFER_PAGES, dtype=torch.bool)
        self.counts = torch.zeros(4, dtype=i64)
        self.cand = torch.zeros(H, SHORTLIST, dtype=i64)
        self.resident = torch.zeros(H, ROWS)
        self.part = (torch.zeros(H, ROWS, D), torch.zeros(H, ROWS))
        self.slots = torch.zeros(H, RECALL_PAGES, dtype=i64)
        hidden, f = 64, 8
        d_in = 2 * D + f
        self.weights = native.MLPWeights(torch.zeros(32 * H, 1, d_in), torch.ones(32 * H, 1, d_in),
                                         torch.zeros(32 * H, d_in, hidden), torch.zeros(32 * H, 1, hidden),
                                         torch.zeros(32 * H, hidden, hidden), torch.zeros(32 * H, 1, hidden),
                                         torch.zeros(32 * H, hidden, 1), torch.zeros(32 * H, 1, 1))
        self.new_k = torch.zeros(H, 1, D, dtype=bf16)
        self.positions = torch.zeros(1, f)
        self.plan = native.RecallPlan(*(torch.zeros(H, RECALL_PAGES, dtype=i64) for _ in range(2)),
                                      torch.zeros(H, dtype=i64), self.held,
                                      *(torch.zeros(H, RECALL_PAGES, dtype=i64) for _ in range(3)))

    def calls(self) -> dict[str, Callable[[], Any]]:
        """One call of each native operation, as a decode step makes it."""
        p, H, R, D = self.plan, HEADS, BUFFER_PAGES, DIM
        return {
            "plan_recall": lambda: native.plan_recall(self.want, self.held, self.pages, self.host_slots, self.ahead,
                                                      self.counts, in_place=True),
            "recall_pages": lambda: native.recall_pages(self.host_k, self.host_per, p.src_rows, p.dst_rows, p.count,
                                                        self.buf_k.view(H * R, PAGE, D), self.host_addr,
                                                        (self.host_v, self.buf_v.view(H * R, PAGE, D),
                                                         self.host_addr)),
            "page_upper_bounds": lambda: native.page_upper_bounds(self.qf, self.bounds, HEADS,
                                                                  addresses=self.index_addr,
                                                                  rows_per_slab=self.index_per),
            "rank_pages": lambda: native.rank_pages(self.qf, self.cand, self.pages, (self.bounds, self.index_per),
                                                    (self.codes, self.index_per), PAGE, DIM ** -0.5, RECALL_PAGES,
                                                    self.resident, (self.index_addr, self.index_addr)),
            "kvp_score": lambda: native.kvp_score(self.new_k, self.new_k, self.positions, self.weights, 0),
            "attend_slabs": lambda: native.attend_slabs(self.q, self.pool_k, self.pool_v, self.entries + 1,
                                                        DIM ** -0.5, addresses=self.pool_addr,
                                                        counted=(self.at, self.entries + 1)),
            "attend_pages": lambda: native.attend_pages(self.q, self.buf_k, self.buf_v, self.slots, PAGE, DIM ** -0.5,
                                                        whole=self.part),
        }


def _median_us(fn: Callable[[], Any], n: int) -> float:
    runs = []
    for _ in range(5):
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return sorted(runs)[2]


def measure_wrapper_cost(contexts: list[int], budget: float = 0.1, n: int = 2000) -> dict[str, Any]:
    """Host microseconds per call of each native operation's own code (launch left out) at each context, and
    per layer and decode step (times `CALLS`), next to a torch operation's; median of five runs of `n`."""
    x = torch.zeros(1)
    torch_us = _median_us(lambda: x.add_(1.0), n)
    rows = []
    with loader.dry_run():
        for context in contexts:
            step = _Step(context, budget)
            per_call = {op: _median_us(fn, n) for op, fn in step.calls().items()}
            per_layer = sum(per_call[op] * CALLS[op] for op in CALLS)
            rows.append({"context": context, "device_entries": step.entries, "demoted_pages": step.pages,
                         "host_slabs": len(step.host_k), "us_per_call": {k: round(v, 2) for k, v in per_call.items()},
                         "us_per_layer_step": round(per_layer, 1),
                         "torch_ops_per_layer_step": round(per_layer / torch_us, 1)})
    return {"torch_op_us": round(torch_us, 2), "calls_per_layer_step": dict(CALLS), "rows": rows,
            "threads": torch.get_num_threads(), "settings": {"device_budget": budget, "calls": n},
            "method": "each operation's whole call under kvtier.native.loader.dry_run (its checks, allocations "
                      "and launch arguments; no kernel built or launched), at the decode shapes of the "
                      f"Llama-3.1-8B shape (8 KV heads x 128, 4 query rows each, bf16), {budget:g} of the context "
                      f"on the device; the torch op is an in-place add on one element; median of five runs of {n} "
                      "calls"}
