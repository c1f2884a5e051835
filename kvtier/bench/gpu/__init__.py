"""`kvtier bench gpu`: the GPU data path and decode speed of kvtier next to its baselines, in one run.

Four measurements, each next to what it is judged against:

- bandwidth: a raw pinned copy (1 GiB by default, each direction) against kvtier's demotion and recall
  batches, timed directly through the layer engine (``LayerEngine._to_host`` and ``_bring_up``, the
  batch moves of the product, synchronised) on one layer of the model's shape filled with random K/V;
- decode step of a Llama model with random weights (bf16, batch 1) at each context: kvtier with a device
  budget as made by default (on CUDA its steps replay from CUDA graphs, timed once they do), the same with
  graphs off, ``DynamicCache`` all on the device and ``DynamicCache(offloading=True)``, all holding the same K/V
  (one chunked prefill through the model, then the same K/V written into the other caches through their
  public ``update``);
- 1M tokens filled synthetically (random K/V written layer by layer through the cache's ``update``), then
  decode steps through the model: GPU bytes of the device tier and the recall index, bytes per tier;
- KVP scoring of every prefill entry, as a fraction of the prefill's time.

Memory growth of the device and pinned host memory over many decode steps is measured on the smallest
context. Each target of the issue is recorded with its measured value and pass/fail; a row that cannot
run (no CUDA for offloading, out of memory) is recorded as skipped with its reason. On ``cpu`` the same
code runs with plain host memory (nothing is pinned) and wall-clock timing, at the sizes asked for.
"""

from __future__ import annotations

from .bandwidth import measure_bandwidth, raw_copy, tier_bandwidth
from .context import ROW_NAMES, kvp_scoring, run_context
from .growth import growth_allowance, memory_snapshot
from .million import MILLION_DEFAULT_LAYERS, MILLION_HOST_SHARE, million_layers, run_million
from .model import DTYPE, ROPE, SHAPES, build_model, kv_bytes_per_token, kvp_for, llama_config
from .report import format_report
from .run import machine, run_gpu_bench
from .settings import GpuBenchConfig
from .steps import decode_steps, prefill
from .targets import TARGET_CONTEXT, evaluate_targets
from .timing import GiB, MiB, Clock, Progress, Skip

__all__ = ["DTYPE", "GiB", "MILLION_DEFAULT_LAYERS", "MILLION_HOST_SHARE", "MiB", "ROPE", "ROW_NAMES", "SHAPES",
           "TARGET_CONTEXT", "Clock", "GpuBenchConfig", "Progress", "Skip", "build_model", "decode_steps",
           "evaluate_targets", "format_report", "growth_allowance", "kv_bytes_per_token", "kvp_for", "kvp_scoring",
           "llama_config", "machine", "measure_bandwidth", "memory_snapshot", "million_layers", "prefill",
           "raw_copy", "run_context", "run_gpu_bench", "run_million", "tier_bandwidth"]
