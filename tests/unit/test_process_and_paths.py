"""A cache in a forked child, a relative disk folder after a change of working folder, and a close whose part
fails: the parent's pages and files stay intact, and the cache's folder always goes."""

from __future__ import annotations

import os

import pytest
import torch

from kvtier import TieredCache, cache_kwargs
from tiny_models import continue_greedy, random_ids, tiny_llama

SETTINGS = dict(device_budget=32, host_budget=16, scorer="keynorm", recall_pages=64)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _prefilled(model, folder) -> tuple[TieredCache, torch.Tensor]:
    cache = TieredCache(model.config, disk_dir=folder, **SETTINGS)
    with torch.no_grad():
        return cache, model(random_ids(model, 256), **cache_kwargs(cache)).logits


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_cannot_use_its_parents_cache(model, tmp_path):
    """Every use the child tries is refused by name (a step, a reset, a park), and the parent goes on exactly as
    a twin that was never forked: the child wrote and removed none of its pages and files."""
    cache, logits = _prefilled(model, tmp_path / "a")
    twin, twin_logits = _prefilled(model, tmp_path / "b")
    cache.park("disk")
    twin.park("disk")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: report what each use raised, then leave at once (no cleanup of the parent's)
        os.close(read)
        said = []
        for use in (lambda: model(random_ids(model, 8), **cache_kwargs(cache)), cache.reset,
                    lambda: cache.park("host"), cache.resume):
            try:
                use()
                said.append("ran")
            except BaseException as e:
                said.append(f"{type(e).__name__}: {e}")
        os.write(write, "\n".join(said).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read().splitlines()
    os.waitpid(pid, 0)
    assert len(said) == 4
    assert all(s.startswith("UnsupportedError: this TieredCache was made in process") and "a fork" in s
               for s in said), said
    got, want = continue_greedy(model, cache, logits, 20), continue_greedy(model, twin, twin_logits, 20)
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    cache.close()
    twin.close()


def test_a_relative_disk_dir_stays_where_it_was_made(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cache, logits = _prefilled(model, "rel")
    assert os.path.isabs(cache.disk_path) and cache.disk_path.startswith(str(tmp_path / "rel"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    cache.park("disk")
    continue_greedy(model, cache, logits, 4)
    cache.close()
    assert os.listdir(tmp_path / "rel") == [] and os.listdir(tmp_path / "elsewhere") == []


def test_a_close_whose_part_fails_still_removes_the_folder(model, tmp_path):
    """A transfer manager whose close raises (a CUDA error left by an earlier failure): the error comes out, and
    the disk store and the private folder with its parked files are let go all the same."""
    cache, _ = _prefilled(model, tmp_path)
    cache.park("disk")
    folder = cache.disk_path
    manager = next(iter(cache._shared.transfers.values()))

    def failing_close():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    manager.close = failing_close
    with pytest.raises(RuntimeError, match="illegal memory access"):
        cache.close()
    assert not os.path.exists(folder) and cache.closed


def test_a_close_whose_layer_fails_still_lets_every_other_part_go(model, tmp_path):
    cache, _ = _prefilled(model, tmp_path)
    cache.park("disk")
    folder, engines = cache.disk_path, cache._engines

    def failing_close():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engines[0].close = failing_close
    with pytest.raises(RuntimeError, match="illegal memory access"):
        cache.close()
    assert not os.path.exists(folder)
    assert engines[1].tiers == [None, None] and engines[1].parked is None   # the layer after it closed too


def test_a_misspelt_sigterm_switch_is_refused_before_any_folder_is_made(tmp_path, monkeypatch):
    from kvtier.bench.synthetic import synthetic_needles
    from kvtier.errors import ConfigError

    monkeypatch.setenv("KVTIER_SIGTERM", "nope")
    with pytest.raises(ConfigError, match="KVTIER_SIGTERM='nope'"):
        synthetic_needles("llama-3.1-8b", context=4096, needles=1, device_budget=0.1, host_budget=0.2,
                          disk_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_folder_whose_owner_file_is_cut_short_is_removed(tmp_path, monkeypatch):
    from kvtier.engine import resources

    def cut(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(resources, "_write_owner", cut)
    with pytest.raises(KeyboardInterrupt):
        resources.make_private_dir(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_page_file_whose_close_reports_an_error_is_still_closed_and_removed(model, tmp_path, monkeypatch):
    """close(2) may report a failed write late (a network file system, a quota); the file is being removed anyway."""
    import errno

    from kvtier.tiers import disk

    cache, _ = _prefilled(model, tmp_path)
    folder = cache.disk_path

    class LateError:   # the disk tier's `os`, whose close(2) reports an error once it has closed the file
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def close(fd):
            os.close(fd)
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk, "os", LateError())
    cache.close()
    monkeypatch.undo()
    assert cache.closed and not os.path.exists(folder)
