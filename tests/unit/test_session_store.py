"""Parked sessions stay within the store's budgets: host first, then disk, then the coldest are dropped."""

from __future__ import annotations

import types

import pytest
import torch

from kvtier import ConfigError, TieredCache
from kvtier.integrations.sessions import SessionStore

CONFIG = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               hidden_size=32, vocab_size=10, _attn_implementation="sdpa")


def _session(tokens=200, seed=0):
    cache = TieredCache(CONFIG, device_budget=0.25, host_budget=0.25, scorer="keynorm")
    g = torch.Generator().manual_seed(seed)
    for layer in range(2):
        k = torch.randn(1, 2, tokens, 8, generator=g)
        cache.update(k, k, layer)
        cache.layers[layer].engine.commit()
    return cache


def test_coldest_sessions_go_to_disk_then_are_dropped():
    caches = {f"s{i}": _session(seed=i) for i in range(4)}
    stats = caches["s0"].stats()  # parked on the host: host pages + device entries + the recall index
    one_host = stats["host"]["bytes"] + stats["device"]["bytes"] + stats["device"]["index_bytes"]
    caches["s0"].park("host")
    assert caches["s0"].stats()["host"]["bytes"] == one_host and caches["s0"].stats()["device"]["index_bytes"] == 0
    store = SessionStore(host_bytes=2 * one_host, disk_bytes=None)
    for name, cache in caches.items():
        store.park(name, cache)
    assert store.where() == {"s0": "disk", "s1": "disk", "s2": "host", "s3": "host"}
    assert store.host_bytes_used() <= 2 * one_host
    one_disk = caches["s0"].stats()["disk"]["bytes"]
    store.disk_bytes = int(2.5 * one_disk)
    store.park("s4", _session(seed=4))
    assert store.disk_bytes_used() <= store.disk_bytes
    assert store.dropped[0] == "s0" and caches["s0"].closed and "s4" in store.where()
    resumed = store.resume("s3")
    assert resumed.parked == "host"
    resumed.resume()
    assert resumed.parked is None and resumed.stats()["device"]["tokens"] > 0
    with pytest.raises(KeyError, match="no parked session 's3'; parked"):
        store.resume("s3")
    with pytest.raises(KeyError, match=f"no parked session 's0' \\(a session 's0' was closed to keep the parked "
                                       f"sessions within disk_bytes={store.disk_bytes:,}: see `dropped`\\)"):
        store.resume("s0")
    store.close()


def test_bad_budget():
    with pytest.raises(ConfigError, match="host_bytes=-1"):
        SessionStore(host_bytes=-1)


def test_a_failed_push_to_disk_keeps_every_session_whole_and_says_how_far_over(monkeypatch):
    from kvtier import CapacityError

    first, second = _session(seed=0), _session(seed=1)
    store = SessionStore(host_bytes=1)   # any second session pushes the first to disk

    def disk_full(to="host"):
        raise CapacityError("disk full")

    store.park("a", first)
    assert store.where() == {"a": "disk"}
    first.resume()                                   # back live, then parked on the host again, but its
    store._parked["a"] = first                       # next push to disk will fail
    first.park("host")
    monkeypatch.setattr(first, "park", disk_full)
    with pytest.raises(CapacityError, match=r"session 'b' is parked in host memory, but moving session 'a' to "
                                            r"disk failed .*bytes over its host budget"):
        store.park("b", second)
    assert store.where() == {"a": "host", "b": "host"}   # both parked and kept, nothing half-moved
    monkeypatch.undo()
    first.resume()
    assert first.stats()["device"]["tokens"] > 0
    store.close()
