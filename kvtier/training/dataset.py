"""Traces loaded as training tensors: per trace, the features and importance of every (layer, head) agent."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS
from ..errors import ConfigError
from ..placement.planner import recent_window
from ..scoring.features import entry_features
from .traces import load_trace, read_manifest


@dataclass
class TraceTensors:
    """One trace: ``features`` ``[agents, n, 2*dim+8]``, ``importance`` ``[agents, n]`` (protected tokens removed),
    ``ages`` ``[n]``: tokens written after each one when the prompt ends (0 for the latest)."""

    features: torch.Tensor
    importance: torch.Tensor
    raw: dict[str, torch.Tensor]
    keep: torch.Tensor            # indices of the rankable (not protected) prompt tokens
    ages: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.ages is None:   # the prompt ends at its last position (at the last rankable one without it)
            n = self.raw["positions"].numel() if "positions" in self.raw else int(self.keep.max()) + 1
            self.ages = n - 1 - self.keep


# a recent window given as a share of the device budget is resolved at this budget (the smallest one graded):
# the tokens it protects there are protected at every larger budget too
REFERENCE_BUDGET = 0.05


TARGETS = ("importance", "importance_next", "importance_decay", "importance_value")


def importance_target(raw: dict[str, torch.Tensor], name: str = "importance") -> torch.Tensor:
    """The importance a scorer is trained (or graded) on, ``[layers, kv_heads, prompt]`` float32.

    ``importance``: future attention summed over every continuation step (the paper's); ``importance_next``:
    the first 16 steps only; ``importance_decay``: step ``t`` weighted by ``exp(-t / 32)``; ``importance_value``:
    the future attention times the entry's value norm (what the entry adds to the attention output, so a
    sink that draws attention but carries a near-zero value counts little).
    """
    if name not in TARGETS:
        raise ConfigError(f"importance={name!r}; allowed: {', '.join(TARGETS)}")
    if name == "importance_value":
        return raw["importance"].float() * raw["values"].float().norm(dim=-1)
    if name not in raw:
        raise ConfigError(f"importance={name!r}: the trace holds no such tensor (recorded before it existed); "
                          "allowed: importance, importance_value, or record the traces again")
    return raw[name].float()


def rankable(n: int, sink_tokens: int, recent_tokens: int | float) -> torch.Tensor:
    """Prompt positions the placement may demote: not sinks, not in the recent window.

    A fractional `recent_tokens` (a share of the device budget) is resolved at `REFERENCE_BUDGET` of `n`.
    """
    window = recent_window(recent_tokens, math.ceil(REFERENCE_BUDGET * n))
    return torch.arange(sink_tokens, max(n - window, sink_tokens))


def load_folder(folder: str | Path, sink_tokens: int = DEFAULT_SINK_TOKENS,
                recent_tokens: int | float = DEFAULT_RECENT_TOKENS,
                importance: str = "importance", manifest: dict | None = None) -> tuple[dict, list[TraceTensors]]:
    """Read every trace of a folder written by `kvtier traces`.

    `importance` names the target (see `importance_target`); `manifest` is the folder's, if already read.
    """
    manifest = read_manifest(folder) if manifest is None else manifest
    out = []
    for item in manifest["traces"]:
        raw = load_trace(Path(folder) / item["file"])
        for name in ("keys", "values", "importance"):   # float16 keys past 65504 are inf: every weight would be NaN
            if name in raw and not torch.isfinite(raw[name]).all():
                raise ConfigError(f"{Path(folder) / item['file']}: its {name} hold values that are not finite; "
                                  "allowed: traces of finite numbers (record them again)")
        layers, heads, n, dim = raw["keys"].shape
        want = tuple(manifest.get(k) for k in ("num_layers", "num_kv_heads", "head_dim"))
        if None not in want and (layers, heads, dim) != want:   # the networks are per layer and head, in order
            raise ConfigError(f"{Path(folder) / item['file']}: its keys are {layers} layers x {heads} KV heads x "
                              f"head size {dim}, but the folder's manifest says {want[0]} x {want[1]} x {want[2]}; "
                              "allowed: shards of the manifest's model (record the folder again)")
        keep = rankable(n, sink_tokens, recent_tokens)
        feats = entry_features(raw["keys"].reshape(layers * heads, n, dim)[:, keep],
                               raw["values"].reshape(layers * heads, n, dim)[:, keep], raw["positions"][keep])
        target = importance_target(raw, importance)
        # keep only the positions of the raw trace: its keys, values and baseline scores are in the features
        # already, and holding them too would double the memory of a folder of long traces
        out.append(TraceTensors(feats, target.reshape(layers * heads, n)[:, keep], {"positions": raw["positions"]},
                                keep))
    return manifest, out
