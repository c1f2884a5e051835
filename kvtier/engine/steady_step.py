"""A decode step planned whole on the host before the model runs: what lets one CUDA graph stand for a model's step.

A layer's decode step on the device path is host bookkeeping around a fixed run of launches (`device_step`). Most
steps are alike: no slab is added, the recall buffer and the index stay where they are; only the count moves on,
on the device and on the host. Such a *steady* step can be split in three (four where it demotes):

- `plan_steady`, before the model runs: whether the step is steady, and if it is, the arguments of its launches and
  their key (`_decode_key`), all from what the layer holds and what its last decode step looked like (the query's,
  keys' and values' shapes, the scale, the sinks, the soft-cap). It changes nothing the layer's length or outcome
  depends on: what it makes (the recall buffer, the step's position, the count's place on the device), the step
  would make anyway, so a step that then runs the ordinary way finds it made;
- `steady_launches`, while the model runs (called by the layer's attention): the launches alone, with the
  tensors the model made; no host state changes. Captured in a graph with the model's own launches, this is
  what a replay repeats;
- `take_steady`, once the step's launches are queued (run, or replayed): the host's part, the length, the count,
  the counters and the read marks, exactly as the ordinary step leaves them;
- `demote_after_steady`, once every layer's step is taken: the demotion the ordinary step's commit would make. A
  step that demotes issues a steady step's launches (the demotion follows them), so a graph captured before it
  stands for it too; the state after it is a new one.

Every step taken so equals the ordinary one bit for bit, and leaves the layer as it would
(`tests/unit/test_model_graph.py`).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import UnsupportedError
from ..scoring import capturable
from .graphs import KeyOnce, StepKey, shapes


class StepMismatch(UnsupportedError):
    """A planned step's attention was called otherwise than planned; raised before its launches (the step can
    run the ordinary way if no other layer launched)."""


class SteadyStep:
    """One layer's planned decode step: its launches' arguments (`run`) and key, what `write` returns the model
    (`placeholder`), whether it fills the pool's last slab (`fills_slab`: the next step adds one, so the state
    under this step's key lasts one step), whether its launches began (`launched`), once they were issued or
    captured, their chosen pages (`ids`), and whether the host took the step (`taken`, on a model's first layer's
    step: set once every layer's is)."""

    __slots__ = ("run", "_key", "placeholder", "how", "fills_slab", "ids", "launched", "taken")

    def __init__(self, run: tuple, key: Callable[[], StepKey], placeholder: tuple[torch.Tensor, torch.Tensor],
                 how: tuple, fills_slab: bool = False) -> None:
        self.run, self._key, self.placeholder, self.how = run, KeyOnce(key), placeholder, how
        self.fills_slab = fills_slab
        self.ids: torch.Tensor | None = None
        self.launched = self.taken = False

    @property
    def key(self) -> StepKey:
        """`_decode_key` of the step, made on first use (only where a graph may stand for the step)."""
        return self._key()


class SteadySteps:
    """The steady decode step of a `LayerEngine`, planned, launched and taken apart (see the module)."""

    def plan_steady(self) -> SteadyStep | None:
        """The next decode step, planned, where it is steady; else None (the step must run the ordinary way)."""
        how = self._steady_how
        # a model with attention sinks (GPT-OSS) may hand them as a new tensor each step: its steps stay ordinary
        if how is None or how[1] is not None or not self._steady_now(how):
            return None
        self.table.settle(ready_only=True)   # as `write` does first (the last demotions' copies, landed)
        if self._unordered:   # as `attend` does: what reads the demoted pages comes after their copies
            self.transfer.order_after(self._unordered)
            self._unordered = []
        scale, sinks, softcap = how[0], how[1], how[2]
        positions = self.shared.positions(self.seen, 1, self.device)
        run, _, recall_key = self._prepare_decode(scale, softcap, sinks, positions, in_step=True)
        key = lambda: self._decode_key(how[3:], run, recall_key())   # noqa: E731
        count = self.pool.count + 1
        return SteadyStep(run, key, self.pool.placeholder(count), how, fills_slab=count == self.pool.capacity)

    def _steady_now(self, how: tuple) -> bool:
        """Whether the next decode step is steady: it recalls on the device with no page on disk, writes its
        entry in its attention and adds no slab (the conditions of `recalls`, `_writes_in_attention` and
        `_pool_kernels`, asked before the step rather than during it)."""
        pool, cfg = self.pool, self.cfg
        if pool is None or self.parked is not None or self.pending is not None or self.index is None:
            return False
        if self.prefetch_in_step is False:   # asked to prefetch on the side stream: host work after the step
            return False
        if not (self.table.n > 0 and cfg.recall_pages > 0 and cfg.mode == "tier"):
            return False
        (q_shape, _, q_dtype), (k_shape, _, k_dtype) = how[3], how[4]
        if self.write_in_attention is False or k_shape[2] != 1 or k_dtype != pool.dtype:
            return False
        if self.holds_disk_pages():   # its step reads its choice back to read disk pages: not launches only
            return False
        if not (self.index.uses_kernels and self.recalls_on_device() and self._defer_nan()
                and capturable(self.scorer) and self._pool_kernels_for(q_shape[1], q_dtype)):
            return False
        # room in the pool's slabs (a step that demotes at its commit is steady too: its launches are a steady
        # step's, and `demote_after_steady` demotes once every layer's step is taken)
        return pool.count + 1 <= pool.capacity

    def steady_launches(self, step: SteadyStep, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scale: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """The planned step's launches with the model's `query`, `k`, `v` (those it planned for: a step called
        otherwise is refused before anything is launched); its attention output ``[1, 1, q_heads, dim]``."""
        got = (scale, sinks, softcap, shapes(query), shapes(k), shapes(v))
        if got[0] != step.how[0] or got[1] is not step.how[1] or got[2] != step.how[2] or got[3:] != step.how[3:]:
            raise StepMismatch(
                f"layer {self.layer_idx}'s decode step was planned for the attention of the step before "
                f"(scale {step.how[0]}, softcap {step.how[2]}, shapes {step.how[3:]}) but was called with scale "
                f"{scale}, softcap {softcap}, shapes {got[3:]}")
        step.launched = True
        out, ids, _ = self._decode_launches(step.run, query, k, v)
        step.ids = ids
        return out

    def take_steady(self, step: SteadyStep) -> None:
        """The host's part of the planned step, once its launches are queued: what `write`, `_decode_on_device`
        and `commit` would have left."""
        self.seen += 1
        self._decoded(step.ids, writes=True)
        self.pool.note_commit()

    def demote_after_steady(self) -> None:
        """The end of the ordinary commit, once the planned step is taken: the demotion, if the step brought the
        pool over its budget. It reads and changes only this layer's pool, index, table, host pages and disk
        pages, which no other layer's step reads, so it may come after every layer's launches rather than before
        the next layer's (the caller runs it under the cache's guard, as the ordinary commit runs)."""
        self._demote()

