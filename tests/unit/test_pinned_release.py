"""Pinned host memory let go by a cache goes back to the system (`kvtier.tiers.pinned`); on a CPU there is none."""

from __future__ import annotations

import torch

from kvtier.tiers import pinned


def test_without_cuda_in_use_nothing_is_asked(monkeypatch):
    asked = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: asked.append(1), raising=False)
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        assert pinned.empty_pinned_cache() is False and asked == []


def test_with_cuda_in_use_torch_is_asked_by_whichever_call_it_has(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: asked.append("accelerator"), raising=False)
    assert pinned.empty_pinned_cache() is True and asked == ["accelerator"]
    monkeypatch.delattr(torch.accelerator, "empty_host_cache")
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: asked.append("cuda"), raising=False)
    assert pinned.empty_pinned_cache() is True and asked == ["accelerator", "cuda"]
