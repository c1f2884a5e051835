"""A failed `TieredCache.park` leaves the cache as it was, with one error type (`CapacityError`) naming the
cause; the files kvtier writes are private (0600, never through a symlink).

Faults are injected at every write site of a park to disk, one call at a time (``os.pwritev`` for the page
file, ``os.write`` for the parked-layer files and the owner file, ``os.open`` and ``tempfile.mkdtemp`` for
files and folders), and with a real ``RLIMIT_FSIZE`` in a subprocess. After each failure the cache must
generate exactly what an untouched twin generates (same tokens, bit-identical logits).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch


import kvtier.tiers.disk as disk_module
from kvtier import CapacityError, TieredCache, cache_kwargs
from kvtier.engine.resources import OWNER_FILE
from tiny_models import continue_greedy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(1))
KINDS = {  # host tier with pages on disk already; no host budget (the private folder is made by the park)
    "tiered": dict(device_budget=24, host_budget=32, recall_pages=1000),
    "no-disk-yet": dict(device_budget=24, host_budget=None, recall_pages=1000),
}


@torch.no_grad()
def prefill(model, cache) -> torch.Tensor:
    return model(PROMPT, **cache_kwargs(cache)).logits




@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """What each kind of cache generates when nothing goes wrong."""
    out = {}
    for kind, settings in KINDS.items():
        with TieredCache(model.config, disk_dir=tmp_path_factory.mktemp(kind), scorer="keynorm", **settings) as c:
            out[kind] = continue_greedy(model, c, prefill(model, c))
    return out


def where(cache) -> list[str | None]:
    return [None if e.parked is None else e.parked.where for e in cache._engines]


def disk_pages(cache) -> int:
    store = cache._shared.disk_store
    return 0 if store is None else store.pages()


def files(cache) -> list[str]:
    """The parked-layer files in the cache's private folder (the folder itself, its owner file and the page
    file are made on first use and stay until close)."""
    path = cache.disk_path
    names = sorted(os.listdir(path)) if path and os.path.isdir(path) else []
    return [n for n in names if n not in (OWNER_FILE, "pages.kvtp")]


def fail_on_call(monkeypatch, module, name: str, n: int, err: int, when=lambda *a: True) -> list[int]:
    """Make ``module.name`` raise ``OSError(err)`` on its `n`-th matching call (counted from 0)."""
    real, calls = getattr(module, name), [0]

    def failing(*args, **kwargs):
        if when(*args):
            calls[0] += 1
            if calls[0] - 1 == n:
                raise OSError(err, os.strerror(err))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)
    return calls


def check_as_before(model, cache, kind, before, reference):
    """The cache is exactly as before the failed park: layers where they were, no file left behind, and it
    generates what the untouched twin generates. `before`: (where, prefill logits, files)."""
    state, logits, names = before
    assert where(cache) == state
    assert files(cache) == names
    tokens, logits = continue_greedy(model, cache, logits)
    assert tokens == reference[kind][0]
    assert torch.equal(logits, reference[kind][1])


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("first", [None, "host"])
@pytest.mark.parametrize("site", ["pwritev", "write"])
def test_disk_full_at_every_write_site_leaves_the_cache_as_it_was(model, reference, tmp_path, monkeypatch,
                                                                  kind, first, site):
    failed_at = set()
    for n in range(50):
        cache = TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **KINDS[kind])
        logits = prefill(model, cache)
        if first:
            cache.park(first)
        state, pages, names = where(cache), disk_pages(cache), files(cache)
        fail_on_call(monkeypatch, os, site, n, errno.ENOSPC)
        try:
            cache.park("disk")
        except CapacityError as e:
            monkeypatch.undo()
            assert "disk full" in str(e) and "as it was" in str(e), str(e)
            failed_at.add(int(str(e).split("failed at layer ")[1].split()[0]))
            assert disk_pages(cache) == pages   # no slot left taken
            check_as_before(model, cache, kind, (state, logits, names), reference)
            cache.close()
            continue
        monkeypatch.undo()
        assert where(cache) == ["disk", "disk"]   # no call left to fail: the park went through
        tokens, out = continue_greedy(model, cache, logits)
        assert tokens == reference[kind][0] and torch.equal(out, reference[kind][1])
        cache.close()
        break
    else:
        pytest.fail("park kept failing")
    assert failed_at == {0, 1}, failed_at   # a failure after layer 0 was parked was undone too


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_write_failure_reported_at_close_leaves_no_file_in_the_way(model, reference, tmp_path, monkeypatch, kind):
    """A network file system or a quota may report a failed write only when the file is closed: the park fails
    and leaves the cache as it was, with no parked-layer file left at its path (one left there refused every
    later park of the layer, 'a file is already in the way'); once the disk is fine again the park goes through."""
    import sys

    cache = TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **KINDS[kind])
    logits = prefill(model, cache)
    before = (where(cache), logits, files(cache))
    real_close, failed = os.close, []

    def close(fd):
        real_close(fd)   # Linux closes the descriptor even where close() reports an error
        if not failed and sys._getframe(1).f_code.co_name == "write_checked":
            failed.append(fd)
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(os, "close", close)
    with pytest.raises(CapacityError, match="could not write .* as it was"):
        cache.park("disk")
    monkeypatch.undo()
    assert failed
    check_as_before(model, cache, kind, before, reference)
    cache.park("disk")
    assert where(cache) == ["disk", "disk"]
    cache.close()


@pytest.mark.parametrize("err, words", [(errno.EMFILE, "too many open files"), (errno.EROFS, "read-only folder"),
                                        (errno.ENFILE, "too many open files"), (errno.EFBIG, "file-size limit")])
@pytest.mark.parametrize("target", ["parked file", "page file", "folder"])
def test_open_failures_are_capacity_errors_naming_the_cause(model, reference, tmp_path, monkeypatch, err, words,
                                                            target):
    kind = "no-disk-yet"
    for n in range(2):   # layer 0's file, then layer 1's (layer 0 parked and put back)
        if target != "parked file" and n:
            break
        cache = TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **KINDS[kind])
        logits = prefill(model, cache)
        if target == "folder":
            fail_on_call(monkeypatch, tempfile, "mkdtemp", 0, err)
        else:
            suffix = ".parked.safetensors" if target == "parked file" else ".kvtp"
            fail_on_call(monkeypatch, os, "open", n, err, when=lambda path, *a: str(path).endswith(suffix))
        with pytest.raises(CapacityError, match=rf"park.*failed at layer {n} \(tiered layer {n + 1} of 2\): {words}"):
            cache.park("disk")
        monkeypatch.undo()
        check_as_before(model, cache, kind, ([None, None], logits, files(cache)), reference)
        if target == "folder":
            assert cache.disk_path is None and not os.listdir(tmp_path)   # no folder was left behind
        cache.close()


def test_no_thread_for_the_io_is_a_capacity_error(model, reference, tmp_path, monkeypatch):
    """A thread limit (RLIMIT_NPROC): the I/O pool cannot start; park raises CapacityError and undoes."""
    class NoThreads:
        def __init__(self, *args, **kwargs):
            pass

        def submit(self, *args, **kwargs):
            raise RuntimeError("can't start new thread")

        def shutdown(self, wait=True):
            pass

    cache = TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **KINDS["tiered"])
    logits = prefill(model, cache)
    before = (where(cache), logits, files(cache))
    monkeypatch.setattr(disk_module, "_MIN_TASK_BYTES", 1)   # every write of 2+ pages goes to the pool
    monkeypatch.setattr(disk_module, "ThreadPoolExecutor", NoThreads)
    with pytest.raises(CapacityError, match="too many threads"):
        cache.park("disk")
    monkeypatch.undo()
    check_as_before(model, cache, "tiered", before, reference)
    cache.close()


@pytest.mark.parametrize("name", ["layer001.parked.safetensors", "pages.kvtp"])
def test_a_symlink_in_the_way_is_refused_and_followed_nowhere(model, reference, tmp_path, name):
    kind = "tiered"
    settings = dict(KINDS[kind], host_budget=10_000) if name == "pages.kvtp" else KINDS[kind]  # no page file yet
    cache = TieredCache(model.config, disk_dir=tmp_path / "d", scorer="keynorm", **settings)
    logits = prefill(model, cache)
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep me")
    os.symlink(outside, os.path.join(cache.disk_path, name))
    before = (where(cache), logits, files(cache))
    with pytest.raises(CapacityError, match=r"park.*failed at layer [01] \(tiered layer [12] of 2\): .*(symlink|in the way)"):
        cache.park("disk")
    assert outside.read_bytes() == b"keep me" and os.path.islink(os.path.join(cache.disk_path, name))
    assert where(cache) == [None, None] and files(cache) == before[2]
    if name == "layer001.parked.safetensors":
        check_as_before(model, cache, kind, before, reference)
    cache.close()
    assert outside.read_bytes() == b"keep me"


def test_files_are_private(model, tmp_path):
    cache = TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **KINDS["tiered"])
    prefill(model, cache)
    cache.park("disk")
    folder = cache.disk_path
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    names = sorted(os.listdir(folder))
    assert {"pages.kvtp", OWNER_FILE, "layer000.parked.safetensors", "layer001.parked.safetensors"} <= set(names)
    for name in names:
        st = os.lstat(os.path.join(folder, name))
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, name
    cache.close()
    assert not os.path.exists(folder)


def test_a_real_file_size_limit(tmp_path):
    """RLIMIT_FSIZE set for real: the page file hits it while a park writes layer 1 (layer 0 is then put
    back), the error names the limit, and the cache goes on exactly like its untouched twin."""
    script = textwrap.dedent(f"""
        import json, os, resource, sys, torch
        torch.set_num_threads(1)
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        from test_reliability_park import KINDS, prefill, where
        from tiny_models import continue_greedy, tiny_llama
        from kvtier import CapacityError, TieredCache
        model = tiny_llama()
        twin = TieredCache(model.config, disk_dir={str(tmp_path)!r}, scorer="keynorm", **KINDS["tiered"])
        expect = continue_greedy(model, twin, prefill(model, twin))
        results = []
        for extra in range(0, 60, 3):   # pages of room left in the file
            cache = TieredCache(model.config, disk_dir={str(tmp_path)!r}, scorer="keynorm", **KINDS["tiered"])
            logits = prefill(model, cache)
            size = cache.stats()["disk"]["reserved_bytes"]
            soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (size + extra * 4096, hard))
            try:
                cache.park("disk")
                error = None
            except CapacityError as e:
                error = str(e)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            state = where(cache)
            tokens, out = continue_greedy(model, cache, logits)
            results.append({{"error": error, "where": state, "same": tokens == expect[0] and
                             bool(torch.equal(out, expect[1]))}})
            cache.close()
            if error is None:
                break
        print(json.dumps(results))
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    errors = [r["error"] for r in results if r["error"]]
    assert results[-1]["error"] is None and results[-1]["where"] == ["disk", "disk"], results
    assert any("failed at layer 1" in e for e in errors) and any("failed at layer 0" in e for e in errors), errors
    for r in results[:-1]:
        assert "file-size limit" in r["error"] and "EFBIG" in r["error"], r
        assert r["where"] == [None, None], r
    assert all(r["same"] for r in results), results


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("first", [None, "host"])
def test_a_lasting_shortage_leaves_the_cache_as_it_was(model, reference, tmp_path, monkeypatch, kind, first):
    """No descriptor left for layer 1's file, nor for any file after it: the layers parked already are put back
    without reading what they wrote (a read would meet the same shortage and break the cache)."""
    cache = TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **KINDS[kind])
    logits = prefill(model, cache)
    if first:
        cache.park(first)
    state, pages, names = where(cache), disk_pages(cache), files(cache)
    real, opened = os.open, []

    def short_of_descriptors(path, *args, **kwargs):
        if str(path).endswith(".parked.safetensors"):
            opened.append(path)
            if len(opened) > 1:
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", short_of_descriptors)
    with pytest.raises(CapacityError, match=r"failed at layer 1 .*too many open files.*as it was before"):
        cache.park("disk")
    assert len(opened) == 2   # layer 0's file was written, layer 1's could not be; nothing was read back
    assert disk_pages(cache) == pages
    check_as_before(model, cache, kind, (state, logits, names), reference)
    monkeypatch.undo()
    cache.park("disk")   # the shortage over, the park goes through
    assert where(cache) == ["disk", "disk"]
    cache.close()


def test_a_park_cut_short_while_its_layers_let_go_breaks_the_cache_and_a_reset_frees_all(model, reference, tmp_path,
                                                                                           monkeypatch):
    """Ctrl-C while the layers let go (after layer 0 did, before layer 1): the cache says it is broken, where a
    layer half let go had given other logits with no error; a reset frees every page and file the park wrote."""
    from kvtier import BrokenCacheError

    kind = "tiered"
    cache = TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **KINDS[kind])
    logits = prefill(model, cache)

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cache._engines[1], "settle_park", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.park("disk")
    monkeypatch.undo()
    assert "interrupted while its layers let go" in cache.broken
    with pytest.raises(BrokenCacheError):
        continue_greedy(model, cache, logits)
    cache.reset()
    assert disk_pages(cache) == 0 and files(cache) == [] and cache.broken is None
    tokens, out = continue_greedy(model, cache, prefill(model, cache))
    assert tokens == reference[kind][0] and torch.equal(out, reference[kind][1])
    cache.close()


def test_a_layer_left_prepared_by_an_interruption_is_undone_by_its_next_park(model, reference, tmp_path):
    """A park whose loop was cut short between two layers' preparations (outside their own handling) left layer 0
    prepared: its next park drops that, and the pages it wrote are freed."""
    kind = "tiered"
    cache = TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **KINDS[kind])
    logits = prefill(model, cache)
    pages = disk_pages(cache)
    cache._engines[0].prepare_park("disk")   # as an interruption right after it would leave it
    assert disk_pages(cache) > pages and where(cache) == [None, None]
    cache.park("disk")
    cache.resume()
    assert disk_pages(cache) == pages
    tokens, out = continue_greedy(model, cache, logits)
    assert tokens == reference[kind][0] and torch.equal(out, reference[kind][1])
    cache.close()


@pytest.mark.parametrize("fails", ["park", "resume"])
def test_no_memory_for_a_host_park_s_pages_leaves_the_cache_usable(model, reference, tmp_path, monkeypatch, fails):
    """Parked on the host, a layer's host pages move into memory of their own size (the slabs go), and back into
    slabs at the restore. Where layer 1's memory is refused (torch's CPU allocator error), a `CapacityError`: a
    park leaves every layer where it was; a restore leaves the cache usable (layer 0 back, layer 1 parked), and
    the next step, the shortage over, goes on as the untouched twin."""
    from kvtier.tiers.host import HostPool

    cache = TieredCache(model.config, disk_dir=tmp_path, scorer="keynorm", **KINDS["no-disk-yet"])
    logits = prefill(model, cache)
    if fails == "resume":
        cache.park("host")
        assert all(e.parked.host_pages is not None and e.host.reserved_bytes() == 0 for e in cache._engines)
    state, names = where(cache), files(cache)
    target = cache._engines[1].host
    name = "load" if fails == "park" else "reopen"
    real = getattr(HostPool, name)

    def refused(self, *args, **kwargs):
        if self is target:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate 4194304 bytes. Error code 12 (Cannot allocate memory)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HostPool, name, refused)
    with pytest.raises(CapacityError, match="layer 1"):
        if fails == "park":
            cache.park("host")
        else:
            cache.resume()
    if fails == "resume":
        assert where(cache) == [None, "host"] and cache.broken is None
        state = where(cache)
    monkeypatch.undo()
    check_as_before(model, cache, "no-disk-yet", (state, logits, names), reference)
    cache.close()
