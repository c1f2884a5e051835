"""A converted copy of a GGUF model in the user's cache folder, so that later loads skip the GGUF parse.

Reading the packaged GGUF file through transformers takes 20-30 s on a small CPU machine, nearly all of it
parsing the tokenizer's metadata and mapping tensor names, not the weights. The first float32 load keeps what
it produced: the dequantized weights (safetensors), the config and the tokenizer, in a folder named after
the file's content (its SHA-256) and the transformers and gguf versions, so that every install of the same file
shares one copy. Later loads build the model from that folder in about 3 s, the same bits. Each file of the copy is
listed with its size and CRC-32. A copy that does not match, or cannot be read as a model's, is removed and made
again from the GGUF file, which stays the source, with a warning; a machine short of memory, open files or disk
space while reading it is no damage: that error is raised and the copy kept. Where the folder cannot be written or
read, loading goes on without a copy.

Each load from a copy marks it used, before it reads it. Making a new copy removes the copies unused for
``UNUSED_DAYS`` and, past ``KEEP`` copies, the least recently used ones (never one used in the last
``BUSY_SECONDS``, which another process may be reading), so that copies made for other transformers versions do
not pile up.

A load from a copy also removes what a load killed while it wrote one (SIGKILL, the OOM killer) left aside a day
ago or more, about 540 MB each: pruning alone would never see it, as no new copy is made any more.

``KVTIER_MODEL_CACHE``: an absolute folder to keep copies in (``~`` expanded), ``off`` (or ``0``, ``no``,
``false``, ``none``, empty) for no copies, or ``on`` (or ``1``, ``yes``, ``true``) for the default folder,
``$XDG_CACHE_HOME/kvtier/models`` where that variable is an absolute path (a relative one is ignored, as the XDG
spec says), else ``~/.cache/kvtier/models``. A relative folder is refused (`ConfigError`): it would put a copy
in whatever folder the program runs from. A copy of the default model takes about 540 MB.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError, short_of_resources
from .user_cache import user_cache_base

log = logging.getLogger(__name__)

ENV = "KVTIER_MODEL_CACHE"
FORMAT = 2   # 2: every file readable by every user (copies of 1 could be their maker's only)
MANIFEST = "kvtier-copy.json"
WEIGHTS = "model.safetensors"
_OFF = {"off", "0", "no", "false", "none"}
_ON = {"on", "1", "yes", "true"}   # the words kvtier's switches read as on (`kvtier.switches.ON`)
BUILDING = ".building-"
KEEP = 3               # copies kept at most when a new one is made
UNUSED_DAYS = 30       # a copy unused this long is removed when a new one is made
BUSY_SECONDS = 600     # a copy used this recently is never removed
STALE_SECONDS = 86400  # what a copy being made left aside this long ago belongs to no live process


def cache_root() -> Path | None:
    """Where copies are kept, or None when ``KVTIER_MODEL_CACHE`` turns them off (see the module's docstring)."""
    value = os.environ.get(ENV)
    if value is not None:
        word = value.strip().lower()
        if word in _OFF or not word:
            return None
        if word not in _ON:
            path = Path(os.path.expanduser(value.strip()))   # an unknown ~user stays relative, not a crash
            if not path.is_absolute():
                raise ConfigError(f"{ENV}={value!r} in the environment is a relative folder (a copy would be "
                                  "kept in every folder the program runs from); allowed: an absolute folder, on "
                                  "(or 1, true, yes: the default folder), off (or 0, false, no, none)")
            return path
    base = user_cache_base()
    return None if base is None else base / "kvtier" / "models"   # no home folder: no copies


def copy_folder(gguf: Path) -> Path | None:
    """The folder of `gguf`'s copy (made or not), or None when copies are off or the file cannot be read."""
    import transformers

    root = cache_root()
    if root is None:
        return None
    try:
        st = gguf.stat()
    except OSError:
        return None
    try:
        digest = _digest(str(gguf.resolve()), st.st_size, st.st_mtime_ns)
    except OSError:
        return None
    key = f"{digest}|{transformers.__version__}|{_gguf_version()}|{FORMAT}"   # gguf dequantizes the weights
    return root / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "none"


@functools.lru_cache(maxsize=8)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    """SHA-256 of a file's content (0.1-0.2 s for the default model), once per process for a given size and
    time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _entry(path: Path) -> dict[str, int] | None:
    """A file's line in the copy's list (None where it is missing)."""
    return {"bytes": path.stat().st_size, "crc32": _crc(path)} if path.is_file() else None


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)


def _listed(folder: Path) -> dict[str, dict[str, int]]:
    return {name: _entry(folder / name) for name in _files(folder)}


def _unlike_list(folder: Path, names: list[str] | None = None) -> list[str]:
    """The files of the copy in `folder` (`names`, or all there and listed) whose size or CRC-32 is not what the
    copy's list says (raises where the list cannot be read)."""
    listed = json.loads((folder / MANIFEST).read_text())["files"]
    if names is None:
        names = sorted(set(listed) | set(_files(folder)))
    return [n for n in names if _entry(folder / n) != listed.get(n)]


def load_copy(folder: Path, source: str, attn: str) -> tuple[Any, Any] | None:
    """``(model, tokenizer)`` in float32 from the copy in `folder`, named as loaded from `source`; None when
    there is no copy this process can read. A copy whose files do not match its list or cannot be read as a
    model's is removed (and None returned); an error that is not the copy's (an attention implementation that
    is not installed, no memory, too many open files: `short_of_resources`) is raised and leaves the copy alone.
    After a load, what a killed load left aside goes (`remove_leftovers`)."""
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    manifest = folder / MANIFEST
    try:
        if not manifest.is_file():
            return None
    except OSError:   # another user's copy, closed to this one: go on without it
        return None

    _mark_used(folder)   # first: another process's pruning spares a copy used this recently (`BUSY_SECONDS`)

    def damaged(e: BaseException) -> None:
        log.warning("the converted copy of the model in %s is damaged (%s: %s); it is removed and made again from "
                    "the GGUF file", folder, type(e).__name__, e)
        shutil.rmtree(folder, ignore_errors=True)

    try:
        bad = _unlike_list(folder)
        if bad:
            raise ValueError(f"{', '.join(bad)} differ from the copy's list (size or CRC-32)")
        config = AutoConfig.from_pretrained(str(folder))
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except PermissionError:   # readable in part only (another user's): not damage, and not ours to remove
        return None
    except Exception as e:   # noqa: BLE001 - any damage: the GGUF file is the source, the copy is made again
        if short_of_resources(e):   # the machine's failure, not the copy's: removing it would not mend it
            raise
        damaged(e)
        return None
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    try:
        missing, unexpected = load_model(model, str(folder / WEIGHTS), strict=True)
        if missing or unexpected:
            raise ValueError(f"weights missing {missing} or unexpected {unexpected}")
    except Exception as e:   # noqa: BLE001 - as above
        if short_of_resources(e):   # the files matched their CRCs: an mmap refused for memory is no damage
            raise
        damaged(e)
        return None
    model.config._name_or_path = model.name_or_path = source   # as the GGUF load names it
    tokenizer.name_or_path = source
    remove_leftovers(folder.parent)
    return model, tokenizer


def remove_leftovers(root: Path, *, now: float | None = None) -> list[Path]:
    """Remove from `root` what copies being made left aside ``STALE_SECONDS`` ago or more (a load killed while
    it wrote one, an interrupted removal); one listing, and nothing else is touched. Returns what was removed."""
    now = time.time() if now is None else now
    removed = []
    try:
        with os.scandir(root) as entries:
            left = [e for e in entries if e.name.startswith(BUILDING)]
    except OSError:   # a folder this process cannot list: the leftovers wait for a load that can
        return removed
    for entry in left:
        try:
            if entry.is_dir(follow_symlinks=False) and \
                    now - entry.stat(follow_symlinks=False).st_mtime > STALE_SECONDS:
                removed.append(Path(entry.path))
        except OSError:   # gone meanwhile (another process removed it)
            continue
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    if removed:
        log.info("removed %d half-made converted model copies left in %s", len(removed), root)
    return removed


def _mark_used(folder: Path) -> None:
    """The copy's list's time says when the copy was last used (what pruning goes by)."""
    try:
        os.utime(folder / MANIFEST)
    except OSError:   # a read-only cache folder: the copy still loads, it only looks older to pruning
        pass


def _last_used(folder: Path) -> float | None:
    try:
        return (folder / MANIFEST).stat().st_mtime
    except OSError:
        return None


def _remove_unless_used(root: Path, copies: list[Path], now: float) -> list[Path]:
    """Remove `copies`, each set aside first and then looked at again: one a load marked used since (a 540 MB
    removal is slow, and loads run meanwhile) is put back, and a load that starts meanwhile reads the GGUF file,
    not a folder going away. Returns those removed."""
    removed = []
    for p in copies:
        aside = root / f"{BUILDING}{p.name}-pruned-{os.getpid()}-{time.time_ns()}"
        try:
            os.rename(p, aside)
        except OSError:   # gone already, or not ours to move
            continue
        used = _last_used(aside)
        if used is not None and now - used <= BUSY_SECONDS:
            try:
                os.rename(aside, p)
                continue
            except OSError:   # a new copy took its place meanwhile: this one goes
                pass
        shutil.rmtree(aside, ignore_errors=True)
        removed.append(p)
    return removed


def prune(root: Path, keep: Path | None = None, *, now: float | None = None) -> list[Path]:
    """Remove from `root` the copies unused for ``UNUSED_DAYS`` and, past ``KEEP`` (counting `keep`, which is
    never removed), the least recently used ones, sparing any used in the last ``BUSY_SECONDS``; and what an
    interrupted copy left aside ``STALE_SECONDS`` ago or more (`remove_leftovers`). Returns what was removed."""
    now = time.time() if now is None else now
    left = remove_leftovers(root, now=now)
    removed: list[Path] = []
    try:
        entries = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(BUILDING)]
    except OSError:
        return left
    copies = []
    for p in entries:
        if p != keep and (used := _last_used(p)) is not None:
            copies.append((used, p))
    copies.sort(reverse=True)                                   # most recently used first
    room = KEEP - (1 if keep is not None else 0)
    for rank, (used, p) in enumerate(copies):
        idle = now - used
        if idle > BUSY_SECONDS and (idle > UNUSED_DAYS * 86400 or rank >= room):
            removed.append(p)
    removed = _remove_unless_used(root, removed, now)
    if removed:
        log.info("removed %d converted model copies unused lately from %s", len(removed), root)
    return left + removed


def load_copy_config(folder: Path, source: str) -> Any | None:
    """The model's config from the copy in `folder` as the GGUF file gives it (without the weights' dtype and
    the GGUF loading note the model's load adds), or None when there is no copy or its config does not match
    its list (the config alone is read: no copy is made for it)."""
    from transformers import AutoConfig

    try:
        if _unlike_list(folder, ["config.json"]):
            return None
        config = AutoConfig.from_pretrained(str(folder))
    except Exception:   # noqa: BLE001 - no usable copy: the caller reads the GGUF file
        return None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = None
    config._name_or_path = source
    _mark_used(folder)
    return config


def store(folder: Path, model: Any, tokenizer: Any) -> bool:
    """Keep a float32 `model` and its `tokenizer` as a copy in `folder`: written aside, then moved into place
    whole. False, with a warning, where it cannot be (the load itself is not affected)."""
    from safetensors.torch import save_model

    if model.dtype != torch.float32:
        raise ValueError(f"a converted copy holds float32 weights; the model is {model.dtype}")
    building = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=BUILDING, dir=folder.parent))
        save_model(model, str(building / WEIGHTS))
        model.config.save_pretrained(str(building))
        tokenizer.save_pretrained(str(building))
        (building / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": _listed(building)}, indent=1))
        # the copy is for every user of the folder: safetensors makes its file its owner's only, mkdtemp its
        # folder, and a umask of 077 the rest (a user who cannot read a file of it would rebuild it at every load)
        for path in building.rglob("*"):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        os.chmod(building, 0o755)
        try:
            os.rename(building, folder)
        except OSError as e:
            if (folder / MANIFEST).is_file():   # another process's copy, made meanwhile
                pass
            elif e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not folder.is_dir():
                raise
            else:   # what an interrupted removal left (files, no list): set aside and removed, then ours goes in
                aside = folder.parent / f"{BUILDING}{folder.name}-{os.getpid()}-{time.time_ns()}"
                os.rename(folder, aside)
                shutil.rmtree(aside, ignore_errors=True)
                os.rename(building, folder)
        prune(folder.parent, keep=folder)
        return True
    except Exception as e:   # noqa: BLE001 - no copy is kept; the model loaded from the GGUF file is returned
        log.warning("could not keep a converted copy of the model in %s (%s: %s); the next load reads the GGUF "
                    "file again (set %s=off to stop trying)", folder, type(e).__name__, e, ENV)
        return False
    finally:
        if building is not None and building.exists():
            shutil.rmtree(building, ignore_errors=True)
