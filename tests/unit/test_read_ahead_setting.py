"""`read_ahead`: reading disk pages ahead of need judged as it goes (None), always (True) or never (False).

The setting moves only where disk pages are read from, never what attention reads: the logits must be the same
bits under each. What the ring does on its own is held in `tests/unit/test_tiers_roundtrip.py`.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvtier import TieredCache
from kvtier.errors import ConfigError

from tiny_models import greedy_logits, tiny_llama


@pytest.mark.parametrize("bad", ["on", 1, 0.5])
def test_read_ahead_must_be_none_or_a_bool(bad):
    with pytest.raises(ConfigError, match=rf"read_ahead={bad!r}; allowed: None \(judged as it goes\), True or False"):
        TieredCache(tiny_llama().config, host_budget=0.2, read_ahead=bad)


def _logits(model, cache):
    return greedy_logits(model, cache, prompt=400, steps=48, seed=5)


def test_read_ahead_changes_where_pages_come_from_never_the_output(tmp_path):
    model = tiny_llama()
    settings = dict(device_budget=0.1, host_budget=0.2, recall_pages=4, page_size=8, disk_dir=tmp_path)
    with TieredCache(model.config, **settings) as auto:
        assert auto.settings.read_ahead is None   # the default: judged as it goes
        expect = _logits(model, auto)
        auto_stats = auto.stats()
    for setting in (True, False):
        with TieredCache(model.config, read_ahead=setting, **settings) as cache:
            assert torch.equal(_logits(model, cache), expect), f"read_ahead={setting} changed the logits"
            st = cache.stats()
            twin = copy.deepcopy(cache)   # with pages on disk: the copy makes the same ring, or none
            try:
                assert twin.settings.read_ahead is setting
                for mine, theirs in zip(cache._engines, twin._engines):
                    if setting:
                        assert theirs.readahead.capacity == mine.readahead.capacity and not theirs.readahead.adaptive
                    else:
                        assert mine.readahead is None and theirs.readahead is None
                    assert theirs._readahead_pages() == mine._readahead_pages()
            finally:
                twin.close()
        assert st["pages_recalled_from"]["disk"] > 0
        ahead = st["read_ahead"]
        if setting:
            assert ahead["pages_read_ahead"] > 0 and ahead["steps_paused"] == 0
        else:   # no ring: every disk page read on demand, and the host tier keeps what the ring would have taken
            assert ahead == {"hits": 0, "misses": 0, "pages_read_ahead": 0, "hit_rate": None, "pages_held": 0,
                             "steps_paused": 0}
            assert st["host"]["tokens"] > auto_stats["host"]["tokens"]
