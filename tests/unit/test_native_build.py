"""The kernels' built binaries on disk: built once per source, options, device and compiler, then read back;
written whole or not at all; kept in a folder of the process's own where the cache folder cannot be written.
(NVRTC's output itself is `test_native_compile.py`'s: the loader's options keep subnormals and round every
operation on its own.)"""

from __future__ import annotations

import pytest

from kvtier.native import build, loader


class Builds:
    """A build function for `cached_binary` that records what it built."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def __call__(self, text: str) -> str:
        self.texts.append(text)
        return f"// built\n{text}"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "kernels"
    monkeypatch.setenv("KVTIER_KERNEL_CACHE", str(folder))
    return folder


def test_a_source_is_built_once_then_read_back(cache):
    builds = Builds()
    path, fresh = build.cached_binary("merge_parts", "text", "sm_90", "nvrtc 13.0", builds)
    assert fresh and path.parent == cache and path.read_bytes() == b"// built\ntext"
    again, fresh = build.cached_binary("merge_parts", "text", "sm_90", "nvrtc 13.0", builds)
    assert again == path and not fresh and builds.texts == ["text"]
    # no temporary file left behind; the binary's digest beside it
    assert sorted(p.name for p in cache.iterdir()) == [path.name, path.name + ".sha256"]


@pytest.mark.parametrize("damage", ["changed", "no digest", "a link"])
def test_a_binary_changed_since_it_was_built_is_built_again(cache, tmp_path, damage):
    """Never handed to the driver on its name alone: a changed binary that still loaded would compute wrong."""
    builds = Builds()
    path, _ = build.cached_binary("merge_parts", "text", "sm_90", "nvrtc 13.0", builds)
    if damage == "changed":
        path.write_bytes(path.read_bytes().replace(b"built", b"bu1lt"))
    elif damage == "no digest":
        (cache / (path.name + ".sha256")).unlink()
    else:
        other = tmp_path / "elsewhere.bin"
        other.write_bytes(path.read_bytes())
        path.unlink()
        path.symlink_to(other)
    again, fresh = build.cached_binary("merge_parts", "text", "sm_90", "nvrtc 13.0", builds)
    assert again == path and fresh and len(builds.texts) == 2
    assert not path.is_symlink() and path.read_bytes() == b"// built\ntext"
    assert build.cached_binary("merge_parts", "text", "sm_90", "nvrtc 13.0", builds)[1] is False


def test_the_processs_own_folder_outlives_a_forked_childs_exit_and_comes_back_if_removed(monkeypatch):
    import os
    import shutil

    monkeypatch.setattr(build, "_fallback", None)
    builds = Builds()
    path, _ = build.cached_binary("gather_pages", "text", "sm_90", "nvrtc", builds, shared=False)
    pid = os.fork()
    if pid == 0:
        build._fallback.cleanup()   # what the child's exit runs
        os._exit(0)
    os.waitpid(pid, 0)
    assert path.is_file()
    shutil.rmtree(path.parent)   # removed by someone else: the next build makes it again
    again, fresh = build.cached_binary("gather_pages", "text", "sm_90", "nvrtc", builds, shared=False)
    assert again == path and fresh and path.is_file()
    build._fallback.cleanup()
    assert not path.parent.exists()


@pytest.mark.parametrize("change", ["text", "target", "compiler", "options"])
def test_a_changed_source_option_device_or_compiler_builds_anew(cache, monkeypatch, change):
    builds = Builds()
    args = {"text": "text", "target": "sm_90", "compiler": "nvrtc 13.0 cupy 14.2.0"}
    first, _ = build.cached_binary("rank_pages", args["text"], args["target"], args["compiler"], builds)
    if change == "options":
        monkeypatch.setattr(build, "OPTIONS", (*build.OPTIONS, "-ftz=true"))
    else:
        args[change] += "x"
    second, fresh = build.cached_binary("rank_pages", args["text"], args["target"], args["compiler"], builds)
    assert fresh and second != first and len(builds.texts) == 2


def test_a_cache_folder_that_cannot_be_written_gives_way_to_a_folder_of_the_process(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVTIER_KERNEL_CACHE", str(blocker / "kernels"))   # under a file: cannot be made
    monkeypatch.setattr(build, "_fallback", None)
    builds = Builds()
    path, fresh = build.cached_binary("gather_pages", "text", "sm_90", "nvrtc", builds)
    assert fresh and path.is_file() and not str(path).startswith(str(blocker))
    again, fresh = build.cached_binary("gather_pages", "text", "sm_90", "nvrtc", builds)
    assert again == path and not fresh and len(builds.texts) == 1
    build._fallback.cleanup()   # what exit does
    assert not path.parent.exists()


def test_a_build_that_fails_leaves_nothing(cache):
    def broken(text: str) -> bytes:
        raise RuntimeError("compile error")

    with pytest.raises(RuntimeError, match="compile error"):
        build.cached_binary("plan_recall", "text", "sm_90", "nvrtc", broken)
    assert not cache.exists() or not any(cache.iterdir())


def test_a_built_binary_is_readable_by_every_user_of_a_shared_folder(cache):
    path, _ = build.cached_binary("kvp_score", "text", "sm_90", "nvrtc", Builds())
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_refused_binary_that_cannot_be_removed_is_built_into_the_processs_own_folder(cache, monkeypatch):
    """What the loader does when the driver refuses a cached binary it cannot remove (another user's, in a
    folder this process may not change): `forget` says so, and the binary is built anew outside the shared
    folder, where later loads of the process find it."""
    monkeypatch.setattr(build, "_fallback", None)
    builds = Builds()
    path, _ = build.cached_binary("index_pages", "text", "sm_90", "nvrtc", builds)
    blocked = cache / "a-folder"
    blocked.mkdir()
    assert build.forget(blocked) is False   # unlink refuses it, as it would another user's file
    own, fresh = build.cached_binary("index_pages", "text", "sm_90", "nvrtc", builds, shared=False)
    assert fresh and own.parent != cache and own.name == path.name and len(builds.texts) == 2
    again, fresh = build.cached_binary("index_pages", "text", "sm_90", "nvrtc", builds, shared=False)
    assert again == own and not fresh
    assert build.cached_binary("index_pages", "text", "sm_90", "nvrtc", builds)[0] == path   # shared: as before
    build._fallback.cleanup()


def test_a_forgotten_binary_is_built_again(cache):
    builds = Builds()
    path, _ = build.cached_binary("pack_entries", "text", "sm_90", "nvrtc", builds)
    assert build.forget(path)
    assert build.forget(path)   # already gone: nothing to do
    again, fresh = build.cached_binary("pack_entries", "text", "sm_90", "nvrtc", builds)
    assert again == path and fresh and len(builds.texts) == 2


def test_the_default_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("KVTIER_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build.cache_dir() == tmp_path / "kvtier" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")   # invalid, says the XDG spec: ignored (it had been used)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert build.cache_dir() == tmp_path / ".cache" / "kvtier" / "kernels"


def test_the_cache_folder_asked_for_is_expanded_and_a_relative_one_refused(monkeypatch, tmp_path):
    """`KVTIER_KERNEL_CACHE="~/k"` (quoted, or set from Python) had made a folder named '~' in the current one, and a
    relative folder had been read from wherever the program ran; refused when a cache is made, not mid-step."""
    from kvtier import ConfigError, TieredCache
    from tiny_models import tiny_llama

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KVTIER_KERNEL_CACHE", "~/k")
    assert build.cache_dir() == tmp_path / "k"
    monkeypatch.setenv("KVTIER_KERNEL_CACHE", f" {tmp_path / 'k'} ")   # the spaces around it are no part of it
    assert build.cache_dir() == tmp_path / "k"
    monkeypatch.setenv("KVTIER_KERNEL_CACHE", "kernels")
    words = "KVTIER_KERNEL_CACHE='kernels' in the environment is a relative folder; allowed: an absolute folder"
    with pytest.raises(ConfigError, match=words):
        build.cache_dir()
    with pytest.raises(ConfigError, match=words):
        TieredCache(tiny_llama().config, device_budget=0.5)


def test_the_loader_builds_with_subnormals_kept_and_no_contraction():
    assert loader.OPTIONS is build.OPTIONS
    assert {"--fmad=false", "--ftz=false", "-std=c++17"} <= set(build.OPTIONS)
