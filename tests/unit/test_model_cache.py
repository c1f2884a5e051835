"""The converted copy of the GGUF default model: the same model and tokenizer, bit for bit, from the copy; a
damaged copy made again; no copy where copies are off or cannot be written."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from kvtier import ConfigError, load_default_model, model_cache
from kvtier.errors import short_of_resources
from kvtier.models import default_model_path, load_config

TEXT = [{"role": "user", "content": "Where is the lantern? ünïcödé, 42, tabs\tand  spaces"}]


def _same(a, b, dtype=torch.float32) -> None:
    (ma, ta), (mb, tb) = a, b
    sa, sb = ma.state_dict(), mb.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(ma.named_buffers(), mb.named_buffers()))
    assert ma.lm_head.weight.data_ptr() == ma.model.embed_tokens.weight.data_ptr()
    assert mb.lm_head.weight.data_ptr() == mb.model.embed_tokens.weight.data_ptr()   # still tied
    assert ma.config.to_dict() == mb.config.to_dict() and ma.name_or_path == mb.name_or_path
    assert ma.generation_config.to_dict() == mb.generation_config.to_dict()
    assert not mb.training and mb.dtype == dtype
    assert ta.chat_template == tb.chat_template and len(ta) == len(tb) and ta.name_or_path == tb.name_or_path
    assert (ta.eos_token, ta.pad_token, ta.bos_token) == (tb.eos_token, tb.pad_token, tb.bos_token)
    prompt = ta.apply_chat_template(TEXT, tokenize=False, add_generation_prompt=True)
    assert prompt == tb.apply_chat_template(TEXT, tokenize=False, add_generation_prompt=True)
    ids = ta(prompt).input_ids
    assert ids == tb(prompt).input_ids and ta.decode(ids) == tb.decode(ids)
    with torch.no_grad():
        x = torch.tensor([ids])
        assert torch.equal(ma(x).logits, mb(x).logits)


def test_a_bfloat16_load_reads_the_copy_and_gives_the_gguf_files_bits(tmp_path, monkeypatch):
    """GGUF weights are dequantised to float32 and then cast: the float32 copy cast to bfloat16 is the same model,
    bit for bit, as the GGUF file read in bfloat16; a first load in bfloat16 keeps a float32 copy."""
    monkeypatch.setenv(model_cache.ENV, "off")
    direct = load_default_model(dtype=torch.bfloat16)
    monkeypatch.setenv(model_cache.ENV, str(tmp_path))
    first = load_default_model(dtype=torch.bfloat16)   # reads the GGUF file in float32, keeps a copy, casts
    from safetensors import safe_open

    folder = model_cache.copy_folder(default_model_path())
    with safe_open(str(folder / model_cache.WEIGHTS), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}

    from transformers import AutoModelForCausalLM

    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF file was read although a copy is kept")

    with monkeypatch.context() as mp:
        mp.setattr(AutoModelForCausalLM, "from_pretrained", no_gguf)
        second = load_default_model(dtype=torch.bfloat16)
    _same(direct, first, torch.bfloat16)
    _same(direct, second, torch.bfloat16)


def test_a_load_keeps_a_copy_that_later_loads_read_instead_of_the_gguf_file(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(model_cache.ENV, str(tmp_path))
    old = time.time() - (model_cache.UNUSED_DAYS + 1) * 86400
    stale = _fake_copy(tmp_path / "SmolLM2-old", old)           # a copy made for another version, long unused
    left = tmp_path / f"{model_cache.BUILDING}x"               # what an interrupted copy left aside
    left.mkdir()
    os.utime(left, (old, old))
    first = load_default_model()                       # reads the GGUF file, keeps a copy, prunes the rest
    folder = model_cache.copy_folder(default_model_path())
    assert folder.parent == tmp_path and (folder / model_cache.MANIFEST).is_file()
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]   # nothing left aside, the stale copy gone
    assert not stale.exists()
    os.utime(folder / model_cache.MANIFEST, (old, old))

    from transformers import AutoModelForCausalLM

    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF file was read although a copy is kept")

    with monkeypatch.context() as mp:
        mp.setattr(AutoModelForCausalLM, "from_pretrained", no_gguf)
        second = load_default_model()
    _same(first, second)   # the copy gives what the GGUF file gave
    assert time.time() - model_cache._last_used(folder) < 60      # the load marked the copy used

    from transformers import AutoConfig

    config_load = AutoConfig.from_pretrained.__func__

    def config_not_from_gguf(cls, *args, **kwargs):
        if "gguf_file" in kwargs:
            raise AssertionError("the GGUF file was read for the config although a copy is kept")
        return config_load(cls, *args, **kwargs)

    with monkeypatch.context() as mp:
        mp.setattr(AutoConfig, "from_pretrained", classmethod(config_not_from_gguf))
        config = load_config(None)
    monkeypatch.setenv(model_cache.ENV, "off")
    assert config.to_dict() == load_config(None).to_dict()   # the same as the GGUF file's
    monkeypatch.setenv(model_cache.ENV, str(tmp_path))

    listed = json.loads((folder / model_cache.MANIFEST).read_text())["files"]
    assert listed == model_cache._listed(folder)           # the copy matches its list

    # one flipped byte in the weights: the copy no longer matches its list and is removed, so the load reads the
    # GGUF file again (the first load's path, which made the copy)
    weights = folder / model_cache.WEIGHTS
    with open(weights, "r+b") as f:
        f.seek(weights.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    with caplog.at_level(logging.WARNING, logger="kvtier.model_cache"):
        assert model_cache.load_copy(folder, str(default_model_path().parent), "sdpa") is None
    assert "model.safetensors differ from the copy's list" in caplog.text and "made again" in caplog.text
    assert not folder.exists()


def test_where_copies_are_kept(monkeypatch, tmp_path):
    gguf = default_model_path()
    for off in ("off", "OFF", "0", ""):
        monkeypatch.setenv(model_cache.ENV, off)
        assert model_cache.cache_root() is None and model_cache.copy_folder(gguf) is None
    monkeypatch.delenv(model_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert model_cache.cache_root() == tmp_path / "kvtier" / "models"
    for on in ("on", "1", "true", "YES"):   # the switches' words for on: the default folder, not a folder so named
        monkeypatch.setenv(model_cache.ENV, on)
        assert model_cache.cache_root() == tmp_path / "kvtier" / "models"
    monkeypatch.chdir(tmp_path)
    for relative in ("cache", "./models", "~no_such_user_here/models"):   # one folder per working directory
        monkeypatch.setenv(model_cache.ENV, relative)
        with pytest.raises(ConfigError, match=f"{model_cache.ENV}='{relative}' in the environment is a relative "
                                              "folder.*allowed: an absolute folder, on .*off"):
            model_cache.copy_folder(gguf)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv(model_cache.ENV, "~/copies")
    assert model_cache.cache_root() == tmp_path / "home" / "copies"
    monkeypatch.delenv(model_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")   # invalid, says the XDG spec: ignored
    assert model_cache.cache_root() == tmp_path / "home" / ".cache" / "kvtier" / "models"
    monkeypatch.setenv(model_cache.ENV, str(tmp_path / "elsewhere"))
    folder = model_cache.copy_folder(gguf)
    assert folder.parent == tmp_path / "elsewhere" and folder.name.startswith(gguf.stem + "-")
    assert model_cache.copy_folder(tmp_path / "missing.gguf") is None
    assert model_cache.load_copy(folder, "x", "sdpa") is None   # no copy made yet


class _FullDisk:
    """A tokenizer whose files cannot be written (the disk filled up after the weights went down)."""

    def save_pretrained(self, where: str) -> None:
        raise OSError(28, "No space left on device")


def test_a_copy_that_cannot_be_written_leaves_no_trace_and_says_so(tmp_path, caplog):
    from transformers import LlamaConfig, LlamaForCausalLM

    small = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="kvtier.model_cache"):
        assert model_cache.store(blocked / "copy", small, _FullDisk()) is False       # no folder to write in
        assert model_cache.store(tmp_path / "copy", small, _FullDisk()) is False      # fails after the weights
    assert caplog.text.count("could not keep a converted copy") == 2 and model_cache.ENV in caplog.text
    assert "No space left on device" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]   # nothing half-written left aside
    with pytest.raises(ValueError, match="float32 weights; the model is torch.bfloat16"):
        model_cache.store(tmp_path / "copy", small.to(torch.bfloat16), _FullDisk())


def _fake_copy(folder, used):
    folder.mkdir()
    (folder / model_cache.MANIFEST).write_text(json.dumps({"format": model_cache.FORMAT, "files": {}}))
    os.utime(folder / model_cache.MANIFEST, (used, used))
    return folder


def test_pruning_spares_a_copy_another_process_marks_used_while_it_removes_others(tmp_path, monkeypatch):
    """The copies' last uses were read once, then the chosen ones removed one after another (540 MB each): a copy
    a load marked used meanwhile, and was reading, was removed under it."""
    now = time.time()
    new = _fake_copy(tmp_path / "new", now)
    first, second = (_fake_copy(tmp_path / name, now - 40 * 86400 - i) for i, name in enumerate(("a", "b")))
    rmtree = model_cache.shutil.rmtree

    def removing(path, *args, **kwargs):
        os.utime(second / model_cache.MANIFEST)   # another process's load marks it used meanwhile
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(model_cache.shutil, "rmtree", removing)
    assert model_cache.prune(tmp_path, keep=new) == [first]
    assert second.is_dir() and not first.exists() and new.is_dir()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(model_cache.BUILDING)]


def test_every_install_of_the_same_file_shares_one_copy(monkeypatch, tmp_path):
    monkeypatch.setenv(model_cache.ENV, str(tmp_path / "copies"))
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b, c):
        d.mkdir()
    (a / "m.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 64)
    shutil.copyfile(a / "m.gguf", b / "m.gguf")
    os.utime(b / "m.gguf", (1e9, 1e9))                   # another install: another place and time
    assert model_cache.copy_folder(a / "m.gguf") == model_cache.copy_folder(b / "m.gguf")
    (c / "m.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 63 + bytes(256))   # other weights
    assert model_cache.copy_folder(c / "m.gguf") != model_cache.copy_folder(a / "m.gguf")
    import transformers

    this_version = model_cache.copy_folder(a / "m.gguf")
    monkeypatch.setattr(transformers, "__version__", "0.0.0")   # each transformers version has its own copy
    assert model_cache.copy_folder(b / "m.gguf") != this_version
    assert model_cache.copy_folder(b / "m.gguf").parent == tmp_path / "copies"


def test_pruning_keeps_the_recent_copies_and_spares_busy_ones(tmp_path):
    now = 1.9e9
    day, keep = 86400, model_cache.KEEP
    new = _fake_copy(tmp_path / "new", now)
    recent = [_fake_copy(tmp_path / f"recent{i}", now - (i + 1) * day) for i in range(keep + 1)]
    busy = _fake_copy(tmp_path / "busy", now - model_cache.BUSY_SECONDS / 2)
    unused = _fake_copy(tmp_path / "unused", now - (model_cache.UNUSED_DAYS + 1) * day)
    other = tmp_path / "not-a-copy"                       # a folder without a copy's list is never touched
    other.mkdir()
    fresh_aside = tmp_path / f"{model_cache.BUILDING}now"  # another process may be writing it
    fresh_aside.mkdir()
    os.utime(fresh_aside, (now - 60, now - 60))

    removed = model_cache.prune(tmp_path, keep=new, now=now)
    # kept: the new copy, the busy one and the most recent others up to KEEP copies in all
    survivors = {p.name for p in tmp_path.iterdir()}
    assert survivors == {"new", "busy", "not-a-copy", fresh_aside.name} | {p.name for p in recent[:keep - 2]}
    assert set(removed) == {unused, *recent[keep - 2:]}
    assert model_cache.prune(tmp_path, keep=new, now=now) == []       # nothing more to remove

    # more copies in use than KEEP: none of them is removed, however many
    many = [_fake_copy(tmp_path / f"busy{i}", now - i) for i in range(keep + 2)]
    assert set(model_cache.prune(tmp_path, keep=new, now=now)) == {p for p in recent[:keep - 2]}
    assert all(p.exists() for p in many + [busy, new])


def _small_copy(folder):
    """A copy of a one-layer random Llama with a word-level tokenizer, stored in `folder` as a load keeps one."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    small = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    words = Tokenizer(WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    assert model_cache.store(folder, small, PreTrainedTokenizerFast(tokenizer_object=words)) is True
    return small


def test_an_error_that_is_not_the_copys_leaves_it_alone(tmp_path):
    """An attention implementation that is not installed (or misspelt) is raised as is; the copy is no damaged
    one, is kept, and loads as ever after."""
    folder = tmp_path / "copy"
    small = _small_copy(folder)
    with pytest.raises((ImportError, ValueError)):
        model_cache.load_copy(folder, "x", "no_such_attention")
    assert (folder / model_cache.MANIFEST).is_file()
    model, _ = model_cache.load_copy(folder, "x", "sdpa")
    want, got = small.state_dict(), model.state_dict()
    assert list(want) == list(got) and all(torch.equal(want[k], got[k]) for k in want)


def test_every_file_of_a_copy_is_readable_by_every_user_whatever_the_umask(tmp_path):
    """Under umask 077 only the folder and the weights were opened to others: the list, config and tokenizer
    stayed their maker's, so any other user rebuilt the copy (and threw it away) at every load."""
    old = os.umask(0o077)
    try:
        _small_copy(tmp_path / "copy")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "copy").rglob("*")}
    assert modes and all(m == (0o755 if (tmp_path / "copy" / n).is_dir() else 0o644) for n, m in modes.items()), modes
    assert model_cache.FORMAT >= 2   # copies of format 1 may be their maker's only: they are not read


def test_a_copy_closed_to_this_user_is_gone_without(tmp_path, monkeypatch, caplog):
    folder = tmp_path / "copy"
    _small_copy(folder)
    assert folder.stat().st_mode & 0o777 == 0o755   # readable by every user of a shared folder
    is_file = Path.is_file

    def closed(self):
        if self.parent == folder:
            raise PermissionError(13, "Permission denied", str(self))
        return is_file(self)

    monkeypatch.setattr(Path, "is_file", closed)
    with caplog.at_level(logging.WARNING, logger="kvtier.model_cache"):
        assert model_cache.load_copy(folder, "x", "sdpa") is None
    assert caplog.text == ""
    monkeypatch.undo()
    assert (folder / model_cache.MANIFEST).is_file()


def test_what_an_interrupted_removal_left_gives_way_to_a_new_copy(tmp_path):
    """Files without the copy's list (a removal cut short): the next copy sets them aside and goes in, where its
    rename had failed at every load, and no copy was ever kept again."""
    folder = tmp_path / "copy"
    small = _small_copy(folder)
    (folder / model_cache.MANIFEST).unlink()
    assert model_cache.load_copy(folder, "x", "sdpa") is None
    _small_copy(folder)
    model, _ = model_cache.load_copy(folder, "x", "sdpa")
    assert [p.name for p in tmp_path.iterdir()] == ["copy"]
    assert not any(torch.equal(a, b) for a, b in zip(small.state_dict().values(), model.state_dict().values())
                   if a.numel() > 64)   # the new copy's weights, not what was left


@pytest.mark.parametrize("failure", [
    RuntimeError("unable to mmap 538090424 bytes from file </x/model.safetensors>: Cannot allocate memory (12)"),
    OSError(errno.EMFILE, "Too many open files"),
    MemoryError(),
], ids=["mmap-enomem", "emfile", "memoryerror"])
@pytest.mark.parametrize("where", ["weights", "check"])
def test_a_machine_short_of_memory_or_files_keeps_the_copy(tmp_path, monkeypatch, caplog, failure, where):
    """The copy's files matched their CRCs (or could not be opened to be checked): a read that fails for want of
    memory or file handles is the machine's failure, raised as is; the copy is no damaged one and stays."""
    import safetensors.torch

    folder = tmp_path / "copy"
    small = _small_copy(folder)

    def short(*args, **kwargs):
        raise failure

    with monkeypatch.context() as mp:
        mp.setattr(safetensors.torch, "load_model", short) if where == "weights" else mp.setattr(
            model_cache, "_crc", short)
        with caplog.at_level(logging.WARNING, logger="kvtier.model_cache"), pytest.raises(type(failure)):
            model_cache.load_copy(folder, "x", "sdpa")
    assert "damaged" not in caplog.text and (folder / model_cache.WEIGHTS).is_file()
    model, _ = model_cache.load_copy(folder, "x", "sdpa")
    assert all(torch.equal(a, b) for a, b in zip(small.state_dict().values(), model.state_dict().values()))

    def unreadable(*args, **kwargs):   # what the content itself gets wrong is damage still
        raise RuntimeError("Error while deserializing header: HeaderTooLarge")

    monkeypatch.setattr(safetensors.torch, "load_model", unreadable)
    with caplog.at_level(logging.WARNING, logger="kvtier.model_cache"):
        assert model_cache.load_copy(folder, "x", "sdpa") is None
    assert "damaged (RuntimeError: Error while deserializing header" in caplog.text and not folder.exists()


def test_short_of_resources_reads_errnos_words_and_causes():
    assert short_of_resources(OSError(errno.ENOSPC, "No space left on device"))
    wrapped = ValueError("could not read")
    wrapped.__cause__ = OSError(errno.ENFILE, "Too many open files in system")
    assert short_of_resources(wrapped)
    for content in (FileNotFoundError(errno.ENOENT, "No such file"), OSError(errno.EIO, "I/O error"),
                    ValueError("weights missing ['lm_head.weight']"), RuntimeError("invalid load key")):
        assert not short_of_resources(content)


def test_a_load_from_a_copy_removes_what_a_killed_load_left(tmp_path):
    """A load killed while it wrote the copy (SIGKILL, the OOM killer) leaves a half-written folder aside; the loads
    after it read the copy and make none, so they remove it themselves once it is a day old."""
    folder = tmp_path / "copy"
    _small_copy(folder)                                 # (making a copy prunes: what is left is made after it)
    old = time.time() - model_cache.STALE_SECONDS - 60
    killed = tmp_path / f"{model_cache.BUILDING}k1ll3d"
    aside = tmp_path / f"{model_cache.BUILDING}copy-123-456"   # what an interrupted removal set aside
    fresh = tmp_path / f"{model_cache.BUILDING}n0w"           # another process may be writing it
    unused = _fake_copy(tmp_path / "another-copy", old)       # a copy: for pruning, by its rules, to remove
    for p in (killed, aside, fresh):
        p.mkdir()
        (p / model_cache.WEIGHTS).write_bytes(bytes(1024))
    for p in (killed, aside):
        os.utime(p, (old, old))
    assert model_cache.load_copy(folder, "x", "sdpa") is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["copy", fresh.name, unused.name])
    assert model_cache.remove_leftovers(tmp_path, now=time.time() + model_cache.STALE_SECONDS + 60) == [fresh]



def test_no_home_folder_means_no_copies_and_kernels_in_a_folder_of_the_process(monkeypatch, tmp_path):
    """HOME unset under a uid with no passwd entry leaves `~` as it is: copies and kernels went to a relative
    '~/.cache' under wherever the program ran."""
    from kvtier.native import build

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv(model_cache.ENV, raising=False)
    monkeypatch.delenv("KVTIER_KERNEL_CACHE", raising=False)
    monkeypatch.setattr(os.path, "expanduser", lambda path: path)
    monkeypatch.setattr(build, "_fallback", None)   # this test's own folder goes with it
    monkeypatch.chdir(tmp_path)
    assert model_cache.cache_root() is None and build.cache_dir() is None
    path, fresh = build.cached_binary("pack_entries", "text", "sm_90", "nvrtc", lambda text: b"binary")
    assert fresh and path.is_absolute() and path.read_bytes() == b"binary" and not (tmp_path / "~").exists()


def test_a_copy_folder_named_with_spaces_around_it_is_that_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(model_cache.ENV, f" {tmp_path / 'copies'} ")
    assert model_cache.cache_root() == tmp_path / "copies"
