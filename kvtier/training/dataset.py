"""Traces loaded as training tensors: per trace, the features and importance of every (layer, head) agent."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS
from ..scoring.features import entry_features
from .traces import load_trace, read_manifest


@dataclass
class TraceTensors:
    """One trace: ``features`` ``[agents, n, 2*dim+8]``, ``importance`` ``[agents, n]`` (protected tokens removed)."""

    features: torch.Tensor
    importance: torch.Tensor
    raw: dict[str, torch.Tensor]
    keep: torch.Tensor            # indices of the rankable (not protected) prompt tokens


def rankable(n: int, sink_tokens: int, recent_tokens: int) -> torch.Tensor:
    """Prompt positions the placement may demote: not sinks, not in the recent window."""
    return torch.arange(sink_tokens, max(n - recent_tokens, sink_tokens))


def load_folder(folder: str | Path, sink_tokens: int = DEFAULT_SINK_TOKENS, recent_tokens: int = DEFAULT_RECENT_TOKENS) -> tuple[dict, list[TraceTensors]]:
    """Read every trace of a folder written by `kvtier traces`."""
    manifest = read_manifest(folder)
    out = []
    for item in manifest["traces"]:
        raw = load_trace(Path(folder) / item["file"])
        layers, heads, n, dim = raw["keys"].shape
        keep = rankable(n, sink_tokens, recent_tokens)
        feats = entry_features(raw["keys"].reshape(layers * heads, n, dim)[:, keep],
                               raw["values"].reshape(layers * heads, n, dim)[:, keep], raw["positions"][keep])
        out.append(TraceTensors(feats, raw["importance"].reshape(layers * heads, n)[:, keep], raw, keep))
    return manifest, out
