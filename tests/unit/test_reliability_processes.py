"""Processes that end without closing their caches: their private folders go away (at exit, on SIGTERM,
or, after SIGKILL, when the next cache is made in the same disk_dir); live folders are never touched."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import types

import pytest

from kvtier import TieredCache
from kvtier.engine import resources
from kvtier.engine.resources import OWNER_FILE, owner_is_gone, remove_stale_dirs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               hidden_size=32, _attn_implementation="sdpa")

CHILD = textwrap.dedent("""
    # One process imports kvtier once (seconds), then forks a process per role (each makes its own cache
    # after the fork, so its own folder, owner file and SIGTERM handling) and reports how each one ended.
    import json, os, signal, sys, time, types
    from kvtier import TieredCache
    config = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   hidden_size=32, _attn_implementation="sdpa")
    TieredCache(config).close()   # loads what a cache needs, makes no folder and sets no handler
    def report(**fields):   # one write a line: with PYTHONUNBUFFERED, print's text and newline are two, and
        sys.stdout.write(json.dumps(fields) + "\\n")   # the processes sharing the pipe could interleave them
        sys.stdout.flush()
    pids = {}
    for role, disk_dir in zip(sys.argv[1::2], sys.argv[2::2]):
        pid = os.fork()
        if pid == 0:
            if role == "own-handler-exit":
                def mine(signum, frame):
                    sys.exit(3)
                signal.signal(signal.SIGTERM, mine)
            cache = TieredCache(config, host_budget=0.1, disk_dir=disk_dir)   # makes the private folder now
            handler = signal.getsignal(signal.SIGTERM)
            report(role=role, pid=os.getpid(), path=cache.disk_path,
                   handler=getattr(handler, "__name__", str(handler)))
            if role == "sleep":
                time.sleep(120)
            sys.exit(0)   # a normal exit, without close()
        pids[pid] = role
    while pids:
        pid, status = os.wait()
        report(ended=pid, signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
               code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None)
        pids.pop(pid, None)
""")


class Children:
    """The forked processes: their reports by name, and how each ended."""

    def __init__(self, base) -> None:
        roles = {"killed": "sleep", "live": "sleep", "exits": "own-handler-exit"}
        self.dirs = {name: base / name for name in roles}
        args = [x for name, role in roles.items() for x in (role, str(self.dirs[name]))]
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("KVTIER_SIGTERM", None)
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.info, self.ended = {}, {}
        by_dir = {str(d): name for name, d in self.dirs.items()}
        while len(self.info) < len(roles):
            line = self.proc.stdout.readline()
            assert line, self.proc.stderr.read()
            report = json.loads(line)
            if "ended" in report:
                self.ended[report["ended"]] = report
                continue
            self.info[by_dir[os.path.dirname(report["path"])]] = report

    def wait(self, name: str, timeout: float = 30.0) -> dict:
        """How the process `name` ended (its parent reaps it and reports)."""
        pid = self.info[name]["pid"]
        while pid not in self.ended:
            line = self.proc.stdout.readline()
            assert line, self.proc.stderr.read()
            report = json.loads(line)
            self.ended[report["ended"]] = report
        return self.ended[pid]

    def close(self) -> None:
        for name, report in self.info.items():
            if report["pid"] not in self.ended:
                try:
                    os.kill(report["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.wait(timeout=30)
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    kids = Children(tmp_path_factory.mktemp("children"))
    yield kids
    kids.close()


def test_the_folder_of_a_killed_process_is_removed_by_the_next_cache(children):
    info, disk_dir = children.info["killed"], children.dirs["killed"]
    path = info["path"]
    assert os.path.isdir(path) and os.path.exists(os.path.join(path, OWNER_FILE))
    os.kill(info["pid"], signal.SIGKILL)
    assert children.wait("killed")["signal"] == signal.SIGKILL
    assert os.path.isdir(path)   # SIGKILL leaves it behind ...
    cache = TieredCache(CONFIG, host_budget=0.1, disk_dir=disk_dir)
    assert not os.path.exists(path)   # ... and the next cache in the same disk_dir removes it
    assert os.listdir(disk_dir) == [os.path.basename(cache.disk_path)]
    cache.close()


def test_live_folders_are_left_alone_and_sigterm_removes_them(children):
    """A sleeping process's folder survives other caches being made beside it. It has no SIGTERM handler of
    its own: kvtier's removes its private folders, then it dies of SIGTERM exactly as it would have."""
    info, disk_dir = children.info["live"], children.dirs["live"]
    assert info["handler"] == "_on_sigterm"
    mine = TieredCache(CONFIG, host_budget=0.1, disk_dir=disk_dir)
    other = TieredCache(CONFIG, host_budget=0.1, disk_dir=disk_dir)   # sweeps again, with two live owners
    assert os.path.isdir(info["path"]) and os.path.isdir(mine.disk_path) and os.path.isdir(other.disk_path)
    assert remove_stale_dirs(str(disk_dir)) == []
    mine.close()
    other.close()
    assert os.path.isdir(info["path"])
    os.kill(info["pid"], signal.SIGTERM)
    assert children.wait("live")["signal"] == signal.SIGTERM
    assert not os.path.exists(info["path"])


def test_normal_exit_without_close_removes_the_folder_and_own_handlers_are_kept(children):
    """A process that set its own SIGTERM handler keeps it (kvtier never replaces one); at its normal exit,
    without close(), the finalizers remove the folder."""
    info = children.info["exits"]
    assert info["handler"] == "mine"
    assert children.wait("exits")["code"] == 0
    assert not os.path.exists(info["path"])


def _fake_folder(parent, name, owner) -> str:
    path = os.path.join(parent, name)
    os.mkdir(path, 0o700)
    if owner is not None:
        with open(os.path.join(path, OWNER_FILE), "w") as f:
            f.write(owner if isinstance(owner, str) else json.dumps(owner))
    with open(os.path.join(path, "pages.kvtp"), "wb") as f:
        f.write(b"\0" * 4096)
    return path


def test_which_folders_count_as_stale(tmp_path):
    """Only a folder whose owner is known to be gone is removed: a dead pid, or a pid now used by a
    process that started at another time. No owner file, a damaged one, another host, PID namespace or
    boot, or a live owner: left alone. Files and folders not named kvtier-* are never looked at."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = resources._owner_record()
    reused = dict(me, start_ticks=(me["start_ticks"] or 0) + 1, start=(me["start"] or 0) - 100)
    gone = {
        "kvtier-dead": dict(me, pid=dead.pid),
        "kvtier-reused": reused,
    }
    kept = {
        "kvtier-mine": me,
        "kvtier-parent": dict(resources._owner_record(), pid=os.getppid(), start_ticks=None, start=None),
        "kvtier-no-owner": None,
        "kvtier-damaged": "{not json",
        "kvtier-elsewhere": dict(me, pid=dead.pid, host=me["host"] + "-other"),
        "kvtier-container": dict(me, pid=dead.pid, pidns="pid:[1]"),   # another PID namespace, same host
        "kvtier-last-boot": dict(me, pid=dead.pid, boot_id="another boot"),
        # written where the PID namespace could not be read: which it was cannot be told, so it is not known gone
        "kvtier-unknown-ns": {k: v for k, v in dict(me, pid=dead.pid).items() if k != "pidns"},
        "not-kvtier": dict(me, pid=dead.pid),
    }
    for key, name in (("pidns", "kvtier-container"), ("boot_id", "kvtier-last-boot"),
                      ("pidns", "kvtier-unknown-ns")):
        if key not in me:   # not Linux: nothing to tell them apart by
            kept.pop(name)
    if me["start_ticks"] is None:   # not Linux: a reused pid is told by psutil's start time, to a second
        gone.pop("kvtier-reused")
    paths = {name: _fake_folder(tmp_path, name, owner) for name, owner in {**gone, **kept}.items()}
    assert {name: owner_is_gone(p) for name, p in paths.items() if name in gone} == {n: True for n in gone}
    removed = remove_stale_dirs(str(tmp_path))
    assert sorted(removed) == sorted(paths[n] for n in gone)
    assert sorted(os.listdir(tmp_path)) == sorted(kept)
    os.symlink(paths["kvtier-mine"], tmp_path / "kvtier-link")   # a symlink is never followed or removed
    assert remove_stale_dirs(str(tmp_path)) == [] and os.path.islink(tmp_path / "kvtier-link")


def test_the_owner_file_is_private(tmp_path):
    cache = TieredCache(CONFIG, host_budget=0.1, disk_dir=tmp_path)
    folder = cache.disk_path
    owner = os.path.join(folder, OWNER_FILE)
    assert oct(os.stat(owner).st_mode & 0o777) == "0o600" and oct(os.stat(folder).st_mode & 0o777) == "0o700"
    record = json.loads(open(owner).read())
    assert record["pid"] == os.getpid() and not owner_is_gone(folder)
    cache.close()
    assert not os.path.exists(folder)


def test_a_symlink_at_the_owner_file_is_refused(tmp_path, monkeypatch):
    """The owner file is made with O_EXCL | O_NOFOLLOW: a symlink placed there (between mkdtemp and the
    write) is refused, nothing is written through it, and no folder is left."""
    import tempfile

    target = tmp_path / "target"
    target.write_text("keep me")
    real = tempfile.mkdtemp

    def mkdtemp_then_plant(*args, **kwargs):
        path = real(*args, **kwargs)
        os.symlink(target, os.path.join(path, OWNER_FILE))
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp_then_plant)
    disk = tmp_path / "disk"
    from kvtier import ConfigError

    with pytest.raises(ConfigError, match="not a writable folder.*(EEXIST|in the way)"):
        TieredCache(CONFIG, host_budget=0.1, disk_dir=disk)
    assert target.read_text() == "keep me" and os.listdir(disk) == []
