"""Sliding-window layers of a parked cache: to host memory or each to a checksummed file, back bit for bit."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from kvtier import CapacityError, TieredCache, cache_kwargs
from kvtier.engine.parking import ParkedFile
from kvtier.errors import CorruptPageError
from kvtier.integrations.sessions import SessionStore

SETTINGS = dict(device_budget=0.25, scorer="keynorm")
WINDOW_FILES = ["window000.parked.safetensors", "window002.parked.safetensors"]


@pytest.fixture(scope="module")
def model():
    """Gemma 2's layout at a toy size: sliding-window layers 0 and 2 (window 64), full-attention layers 1 and 3."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    torch.manual_seed(0)
    cfg = Gemma2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, vocab_size=256, num_hidden_layers=4, sliding_window=64,
                       layer_types=["sliding_attention", "full_attention"] * 2, attn_logit_softcapping=None,
                       final_logit_softcapping=None)
    cfg._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(cfg).eval()


def _prefilled(model, tmp_path, name: str, seed: int = 2, tokens: int = 150) -> TieredCache:
    cache = TieredCache(model.config, disk_dir=tmp_path / name, **SETTINGS)
    ids = torch.randint(1, 256, (1, tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
    return cache


@torch.no_grad()
def _steps(model, cache, n: int = 6) -> torch.Tensor:
    """`n` steps of fixed tokens through `cache`: their logits."""
    ids = torch.arange(7, 7 + n)[None]
    return torch.cat([model(ids[:, i:i + 1], **cache_kwargs(cache)).logits for i in range(n)])


def _window_files(cache) -> list[str]:
    return sorted(f for f in os.listdir(cache.disk_path) if f.startswith("window"))


def test_windows_parked_on_disk_hold_no_memory_and_come_back_bit_for_bit(model, tmp_path):
    with _prefilled(model, tmp_path, "a") as parked, _prefilled(model, tmp_path, "b") as twin:
        live = twin.stats()["window"]
        assert live["bytes"] > 0 and live["disk_bytes"] == 0
        parked.park("host")
        parked.park("disk")   # from host memory (a CPU's windows stay where they are) to disk
        held = parked.stats()["window"]
        assert held["bytes"] == 0 and held["disk_bytes"] > live["bytes"] and held["tokens"] == live["tokens"]
        assert parked.parked == "disk" and _window_files(parked) == WINDOW_FILES
        parked.park("host")   # a window on disk stays there, as a tiered layer does
        assert parked.stats()["window"]["bytes"] == 0
        assert torch.equal(_steps(model, parked), _steps(model, twin))
        assert _window_files(parked) == [] and parked.parked is None
        assert parked.stats()["window"] == twin.stats()["window"]


def test_windows_on_disk_are_read_ahead_with_the_layers(model, tmp_path):
    with _prefilled(model, tmp_path, "a") as parked, _prefilled(model, tmp_path, "b") as twin:
        parked.park("disk")
        assert parked.prefetch_parked()
        parked.resume()
        ahead = parked.stats()["resume_prefetch"]
        assert ahead["layers"] == 4 and ahead["failed"] == 0   # two tiered layers, two windows
        assert torch.equal(_steps(model, parked), _steps(model, twin))


def test_a_changed_window_file_is_an_error_and_leaves_the_cache_usable(model, tmp_path):
    with _prefilled(model, tmp_path, "a") as cache:
        cache.park("disk")
        path = os.path.join(cache.disk_path, WINDOW_FILES[1])
        with open(path, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte[0] ^ 1]))
        for _ in range(2):   # the same error each time, never a step over a wrong window
            with pytest.raises(CorruptPageError, match="parked window file .*window002.* fails its CRC-32 check"):
                _steps(model, cache, 1)
        assert cache.broken is None and cache.stats()["tokens_seen"] == 150
        cache.reset()
        assert _window_files(cache) == [] and cache.stats()["window"]["disk_bytes"] == 0


@pytest.mark.parametrize("fails", ["second window", "a tiered layer"])
def test_a_failed_park_puts_the_windows_back(model, tmp_path, monkeypatch, fails):
    """Disk full at the second window's file, or at a tiered layer's park after both windows went to disk: every
    layer as it was (the first window's file gone), and the steps after as a twin's that was never parked. Putting
    the layers back reads nothing: here no parked file could be read (a cause that lasts, such as no file
    descriptors left, would fail a read too)."""
    with _prefilled(model, tmp_path, "a") as cache, _prefilled(model, tmp_path, "b") as twin:
        full = OSError(errno.ENOSPC, "No space left on device")

        def unreadable(self):
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(ParkedFile, "read", unreadable)
        if fails == "second window":
            write = ParkedFile.write.__func__

            def write_once(cls, path, tensors, what):
                if _window_files(cache):
                    raise full
                return write(cls, path, tensors, what)

            monkeypatch.setattr(ParkedFile, "write", classmethod(write_once))
            match = "could not move the sliding-window layers to disk: .*No space left.*; every layer is as it was"
        else:
            def park(to):
                raise full

            monkeypatch.setattr(cache._engines[1], "prepare_park", park)
            match = "failed at layer 3 .*every layer is as it was"
        with pytest.raises(CapacityError, match=match):
            cache.park("disk")
        monkeypatch.undo()
        assert cache.parked is None and _window_files(cache) == [] and cache.broken is None
        assert cache.stats()["window"] == twin.stats()["window"]
        assert torch.equal(_steps(model, cache), _steps(model, twin))


def test_a_session_store_of_a_hybrid_model_keeps_within_its_host_budget(model, tmp_path):
    """Sessions pushed to disk take their windows with them, so the store fits its budget (the windows stayed in
    host memory before, counted against it, with nothing left to push)."""
    sessions = [_prefilled(model, tmp_path, f"s{i}", seed=i) for i in range(4)]
    one = sessions[0]
    one.park("host")
    stats = one.stats()
    on_host = stats["host"]["reserved_bytes"] + stats["window"]["bytes"]
    store = SessionStore(host_bytes=on_host + on_host // 2)
    try:
        for i, cache in enumerate(sessions):
            store.park(f"s{i}", cache)
        assert store.where() == {"s0": "disk", "s1": "disk", "s2": "disk", "s3": "host"}
        assert store.host_bytes_used() <= store.host_bytes
        assert store.disk_bytes_used() == sum(c.stats()["disk"]["reserved_bytes"] + c.stats()["window"]["disk_bytes"]
                                              for c in sessions[:3])
    finally:
        store.close()


def test_a_park_cut_short_by_ctrl_c_leaves_no_file_in_the_way(model, tmp_path, monkeypatch):
    """The half-written file goes with the interruption: a later park writes its file anew, where every later park
    had been refused ("a file is already in the way")."""
    from kvtier.engine import parking

    with _prefilled(model, tmp_path, "a") as cache, _prefilled(model, tmp_path, "b") as twin:
        def cut(fd, data):
            raise KeyboardInterrupt

        cache._shared.private_dir()   # made first (its owner file is written with os.write too)
        monkeypatch.setattr(parking.os, "write", cut)
        with pytest.raises(KeyboardInterrupt):
            cache.park("disk")
        monkeypatch.undo()
        assert _window_files(cache) == [] and cache.parked is None and cache.broken is None
        cache.park("disk")
        assert torch.equal(_steps(model, cache), _steps(model, twin))


def test_a_window_file_that_cannot_be_opened_for_want_of_descriptors_is_a_capacity_error(model, tmp_path,
                                                                                           monkeypatch):
    """Not a `CorruptPageError`: the file is fine, and the step goes on once descriptors are free again."""
    from kvtier.engine import parking

    with _prefilled(model, tmp_path, "a") as cache, _prefilled(model, tmp_path, "b") as twin:
        cache.park("disk")
        opened = parking.os.open

        def no_descriptors(path, *args, **kwargs):
            if "window" in str(path):
                raise OSError(errno.EMFILE, "Too many open files")
            return opened(path, *args, **kwargs)

        monkeypatch.setattr(parking.os, "open", no_descriptors)
        with pytest.raises(CapacityError, match="could not read the parked window file .*too many open files"):
            _steps(model, cache, 1)
        monkeypatch.undo()
        assert cache.broken is None
        assert torch.equal(_steps(model, cache), _steps(model, twin))


@pytest.mark.parametrize("when", ["after a window's file is written", "after a layer's file is written",
                                  "as a restored window's file is removed"])
def test_a_file_left_by_a_ctrl_c_is_replaced_by_the_next_park(model, tmp_path, monkeypatch, when):
    """An interruption at the wrong moment may leave a parked file behind; it is the cache's own (the folder is
    private), so the next park replaces it, where every later park had been refused ("a file is in the way")."""
    from kvtier.engine import parking

    with _prefilled(model, tmp_path, "a") as cache, _prefilled(model, tmp_path, "b") as twin:
        if when == "as a restored window's file is removed":
            cache.park("disk")

            def cut(self):
                raise KeyboardInterrupt

            monkeypatch.setattr(ParkedFile, "discard", cut)
            with pytest.raises(KeyboardInterrupt):
                cache.resume()
        else:
            write = parking.write_checked

            def cut(path, tensors):
                written = write(path, tensors)
                if ("window" in path) == (when == "after a window's file is written"):
                    raise KeyboardInterrupt
                return written

            monkeypatch.setattr(parking, "write_checked", cut)
            with pytest.raises(KeyboardInterrupt):
                cache.park("disk")
            assert cache.broken is None
        monkeypatch.undo()
        assert any(name.endswith(".parked.safetensors") for name in os.listdir(cache.disk_path))
        for _ in range(2):
            cache.park("disk")
            assert cache.parked == "disk"
            cache.resume()
        assert torch.equal(_steps(model, cache), _steps(model, twin))
