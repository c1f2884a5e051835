"""The settings of one run, checked when made (the CLI builds them from its options; the JSON records them)."""

from __future__ import annotations

from dataclasses import dataclass

from .model import SHAPES


@dataclass(frozen=True)
class GpuBenchConfig:
    """Settings of one `run_gpu_bench` run (sizes in tokens unless named otherwise)."""

    device: str = "cuda"
    shape: str = "llama-3.1-8b"
    layers: int | None = None             # None: the shape's own; fewer = a truncated shape (reported)
    contexts: tuple[int, ...] = (32768, 131072)
    million: bool = True
    million_context: int = 2**20
    million_layers: int | None = None     # None: auto (at most MILLION_DEFAULT_LAYERS, as host memory allows)
    device_budget: float | int = 0.1
    recall_pages: int = 64
    steps: int = 10                       # timed decode steps per row (median reported)
    warmup: int = 3
    growth_steps: int = 1000
    growth_seconds: float = 120.0         # stop the growth run early past this (recorded)
    time_limit: float | None = 285.0      # seconds for the whole command, start-up included: the growth run goes
                                          # last and stops in time to keep to it; None: no limit
    prefill_chunk: int = 8192
    fill_chunk: int = 65536               # synthetic 1M fill: tokens per update
    copy_mib: int = 1024                  # the raw pinned copy
    batch_mib: int = 64                   # demotion and recall batches
    repeats: int = 3
    eager: bool = True                    # also a kvtier row with CUDA graphs off, at each context
    decode_graph: bool = True             # also a kvtier row stepped by DecodeGraph (the whole step one graph)
    sustained_steps: int = 300            # then that row's steps over several demotions, captures included
    no_prefetch: bool = True              # also kvtier rows without prefetch and with it on the side stream,
                                          # at the largest context
    disk_host_budget: float | None = 0.5  # the disk rows' host budget (fraction of the context; past it, pages
                                          # go to disk), at the smallest context; None: no disk rows
    profile_steps: int = 0                # kvtier steps profiled (cProfile) after each kvtier row's timed ones
    seed: int = 0

    def __post_init__(self) -> None:
        from ...errors import ConfigError

        if self.shape not in SHAPES:
            raise ConfigError(f"shape={self.shape!r}; allowed: {', '.join(SHAPES)}")
        if self.layers is not None and not 1 <= self.layers <= SHAPES[self.shape]["num_hidden_layers"]:
            raise ConfigError(f"layers={self.layers}; allowed: 1 to {SHAPES[self.shape]['num_hidden_layers']}")
        for name in ("steps", "warmup", "prefill_chunk", "fill_chunk", "copy_mib", "batch_mib", "repeats",
                     "profile_steps", "sustained_steps"):
            if getattr(self, name) < (0 if name in ("warmup", "profile_steps", "sustained_steps") else 1):
                raise ConfigError(f"{name}={getattr(self, name)} is out of range")

        if self.time_limit is not None and not self.time_limit > 0:
            raise ConfigError(f"time_limit={self.time_limit}; allowed: seconds > 0, or None for no limit")
        if self.disk_host_budget is not None and not 0 < self.disk_host_budget < 1:
            raise ConfigError(f"disk_host_budget={self.disk_host_budget}; allowed: a fraction between 0 and 1 "
                              "(exclusive), or None for no disk rows")

    @property
    def num_layers(self) -> int:
        return self.layers or SHAPES[self.shape]["num_hidden_layers"]
