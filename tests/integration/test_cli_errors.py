"""Mistakes on the command line: one line (`kvtier: error: ...`), exit 2, no traceback, and nothing loaded.

Every check here has to fail before the model loads: an autouse fixture makes any model load fail the
test. Failures while running (not the caller's fault) exit 3, also in one line. With --json a failure also
prints `{"error": ..., "exit_code": N}` as one line on stdout.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli import main


class ModelLoaded(Exception):
    pass


LOADS: list[str] = []   # the loads tried by the test running (the CLI reports the refusal as a load that failed)


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch):
    """Any attempt to load a model fails the test: every check must come before the (slow) load."""
    import kvtier.models

    def refuse(*args, **kwargs):
        LOADS.append("load")
        raise ModelLoaded("a test of option checks tried to load a model")

    LOADS.clear()
    monkeypatch.setattr(kvtier.models, "_load", refuse)


def run(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def assert_one_line(result, code=2, *words):
    """Exit `code`, one `kvtier: error:` line on stderr (naming `words`), no traceback, no usage block."""
    assert not LOADS, "the model was loaded before the check"
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvtier: error: "), lines[0]
    assert "Usage:" not in result.output and "Try '" not in result.output
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def assert_json_error(result, code=2, *words):
    """The one line on stderr and the JSON object as the only line on stdout."""
    line = assert_one_line(result, code, *words)
    out = result.stdout.strip().splitlines()
    assert len(out) == 1, result.stdout
    data = json.loads(out[0])
    assert data == {"error": line.removeprefix("kvtier: error: "), "exit_code": code}
    return data


# ---------------------------------------------------------------------------------------------------- demo

@pytest.mark.parametrize("value", ["0", "10", "-5", "inf", "-inf", "nan", "abc", "", "1e30", "K"])
def test_demo_synthetic_bad_context(value):
    assert_one_line(run("demo", "--synthetic", "--context", value), 2, "--context", repr(value), "allowed")


@pytest.mark.parametrize("args, words", [
    (["--needles", "0"], ["--needles", "0"]),
    (["--needles", "-3"], ["--needles"]),
    (["--needles", "x"], ["--needles"]),
    (["--threads", "0"], ["--threads", "0"]),
    (["--threads", "two"], ["--threads"]),
    (["--threads", "99999999999999999999"], ["--threads"]),
    (["--recall-pages", "0"], ["--recall-pages", "allowed"]),
    (["--recall-pages", "-1"], ["--recall-pages"]),
    (["--arch", "nope"], ["--arch", "'nope'", "llama-3.1-8b"]),
    (["--context", "256", "--needles", "10"], ["--needles", "at most"]),
    (["--device-budget", "abc"], ["--device-budget", "'abc'", "allowed"]),
    (["--device-budget", "nan"], ["--device-budget", "'nan'"]),
    (["--device-budget", "2"], ["device_budget=2", "allowed"]),
    (["--device-budget", "none"], ["device_budget=None"]),
    (["--host-budget", "-1"], ["host_budget=-1", "allowed"]),
    (["--host-budget", "none"], ["--host-budget", "'none'", "allowed"]),
    (["--scorer", "nope"], ["--scorer", "'nope'", "keynorm"]),
    (["--scorer", "snapkv"], ["--scorer", "'snapkv'", "no model runs", "keynorm, keydiff, random"]),
    (["--scorer", "kvp"], ["--scorer", "'kvp'", "KVP weights"]),
    (["--model", "/somewhere"], ["--model", "'/somewhere'", "no model runs"]),
    (["--context", "4096", "--device-budget", "1.0"], ["--device-budget", "holds all 4,096 tokens", "below"]),
    (["--context", "4096", "--device-budget", "100000"], ["--device-budget", "nothing is demoted"]),
])
def test_demo_synthetic_bad_options(args, words):
    assert_one_line(run("demo", "--synthetic", *args), 2, *words)


def test_demo_arch_without_synthetic_is_refused():
    """--arch shapes the synthetic KV only; without --synthetic it had been taken and ignored."""
    assert_one_line(run("demo", "--arch", "bogus", "--context", "256"), 2, "--arch", "'bogus'", "without --synthetic")


def test_demo_synthetic_larger_than_the_disk(tmp_path):
    line = assert_one_line(run("demo", "--synthetic", "--context", "1000M", "--disk-dir", tmp_path), 2, "--context")
    assert "free" in line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("value", ["0", "10", "-5", "inf", "abc", "1M"])
def test_demo_model_context_out_of_range(value):
    assert_one_line(run("demo", "--context", value), 2, "--context", "allowed")


def test_demo_long_context_points_at_synthetic():
    assert_one_line(run("demo", "--context", "1M"), 2, "--synthetic")


def test_demo_unknown_scorer_before_loading():
    line = assert_one_line(run("demo", "--scorer", "nope"), 2, "--scorer", "'nope'")
    from kvtier.scoring import available_scorers

    assert all(name in line for name in available_scorers())


def test_demo_json_failure_prints_json_object():
    data = assert_json_error(run("demo", "--synthetic", "--context", "0", "--json"), 2, "--context")
    assert "'0'" in data["error"]


def test_demo_synthetic_honours_disk_dir(tmp_path, monkeypatch):
    import kvtier.bench.synthetic as synthetic

    seen = {}

    def fake(arch, tokens, needles, device_budget, host_budget, recall_pages, disk_dir=None, **kwargs):
        seen.update(disk_dir=disk_dir, exists=disk_dir is not None and os.path.isdir(disk_dir))
        return {"arch": arch, "context": tokens, "needles": []}

    monkeypatch.setattr(synthetic, "synthetic_needles", fake)
    disk = tmp_path / "disk"
    result = run("demo", "--synthetic", "--context", "4K", "--needles", "1", "--disk-dir", disk, "--json")
    assert result.exit_code == 0, result.output
    assert seen == {"disk_dir": str(disk), "exists": True}


def test_demo_synthetic_writes_its_pages_in_disk_dir(tmp_path, monkeypatch):
    """A real (small) synthetic run: its private folder is made inside --disk-dir, and removed after."""
    import kvtier.engine.resources as resources

    made = []
    real_mkdtemp = resources.tempfile.mkdtemp

    def spy(*args, **kwargs):
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(resources.tempfile, "mkdtemp", spy)
    disk = tmp_path / "disk"
    result = run("demo", "--synthetic", "--context", "4K", "--needles", "1", "--disk-dir", disk, "--json")
    assert result.exit_code == 0, result.output
    assert len(made) == 1 and Path(made[0]).parent == disk
    assert json.loads(result.stdout)["usage"]["disk"]["tokens"] > 0
    assert not list(disk.iterdir())


# ------------------------------------------------------------------------------------------------- disk-dir

def test_disk_dir_not_creatable_is_a_user_mistake():
    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc")
    assert_one_line(run("demo", "--synthetic", "--disk-dir", "/proc/nope"), 2, "--disk-dir", "/proc/nope",
                    "not a writable folder")
    assert_json_error(run("demo", "--disk-dir", "/proc/nope", "--json"), 2, "--disk-dir")


def test_disk_dir_below_a_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_one_line(run("chat", "--disk-dir", blocker / "sub"), 2, "--disk-dir", "not a writable folder")
    assert_one_line(run("chat", "--disk-dir", blocker), 2, "--disk-dir", "is a file")
    assert_one_line(run("demo", "--disk-dir", ""), 2, "--disk-dir", "empty")


def test_full_disk_at_folder_creation_is_a_user_mistake(tmp_path, monkeypatch):
    import kvtier.cli.common as common

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(common.tempfile, "TemporaryFile", full)
    assert_one_line(run("demo", "--disk-dir", tmp_path / "d"), 2, "--disk-dir", "No space left on device")
    assert not list(tmp_path.iterdir())


def test_checks_create_no_folders(tmp_path, monkeypatch):
    """The disk-dir check passes, the run stops at the (refused) model load: nothing was made in the folder."""
    disk = tmp_path / "disk"
    run("demo", "--disk-dir", disk, "--context", "1200", "--needles", "1")
    assert LOADS  # got as far as loading: every check passed
    assert not disk.exists()
    disk.mkdir()
    run("demo", "--disk-dir", disk, "--context", "1200", "--needles", "1")
    assert not list(disk.iterdir())  # no kvtier-XXXX/.probe left by the checks


# ---------------------------------------------------------------------------------------------------- bench

@pytest.mark.parametrize("args, words", [
    (["--context", "0"], ["--context", "0"]),
    (["--context", "-5"], ["--context"]),
    (["--context", "abc"], ["--context", "abc"]),
    (["--context", str(10**20)], ["--context"]),
    (["--new-tokens", "0"], ["--new-tokens", "0"]),
    (["--rounds", "0"], ["--rounds", "0"]),
    (["--threads", "0"], ["--threads"]),
    (["--recall-pages", "-1"], ["--recall-pages"]),
    (["--device", "nope"], ["--device", "'nope'", "cpu"]),
    (["--device", "mps"], ["--device", "'mps'", "cpu"]),
    (["--device", "cuda:99"], ["--device", "cuda:99"]),
    (["--device-budget", "5"], ["device_budget=5"]),
    (["--device-budget", "abc"], ["--device-budget", "'abc'"]),
    (["--host-budget", "2.5"], ["host_budget=2.5"]),
    (["--scorer", "nope"], ["--scorer", "'nope'", "keynorm"]),
    (["--cold-disk"], ["--host-budget", "with --cold-disk", "sends pages to disk"]),
    (["--read-ahead", "off"], ["--host-budget", "with --read-ahead off", "sends pages to disk"]),
    (["--host-budget", "0.5", "--read-ahead", "auto,maybe"], ["--read-ahead", "'maybe'", "'auto', 'on', 'off'"]),
    (["--promote", "on"], ["--host-budget", "with --promote on", "sends pages to disk"]),
    (["--host-budget", "0.5", "--promote", "on,yes"], ["--promote", "'yes'", "'on', 'off'"]),
    (["--retain-pages", "0,x"], ["--retain-pages", "'x'", "whole numbers >= 0"]),
    (["--retain-pages", "-2"], ["--retain-pages", "has -2", "whole numbers >= 0"]),
])
def test_bench_decode_bad_options(args, words):
    assert_one_line(run("bench", "decode", *args), 2, *words)


@pytest.mark.parametrize("args, words", [
    (["--prefetch-pages", "0,x"], ["--prefetch-pages", "'x'", "whole numbers"]),
    (["--prefetch-pages", "-1"], ["--prefetch-pages", "'-1'"]),
    (["--prefetch-pages", "4,"], ["--prefetch-pages"]),
    (["--context", "100"], ["--context", "256"]),
    (["--recall-pages", "0"], ["--recall-pages"]),
    (["--device-budget", "none"], ["--device-budget", "no device tier"]),
])
def test_bench_prefetch_bad_options(args, words):
    assert_one_line(run("bench", "prefetch", *args), 2, *words)


@pytest.mark.parametrize("args, words", [
    (["--think-ms", "0,x"], ["--think-ms", "'x'", "milliseconds from 0 to 600000"]),
    (["--think-ms", "-1"], ["--think-ms", "'-1'"]),
    (["--think-ms", "nan"], ["--think-ms", "'nan'"]),
    (["--think-ms", "0,"], ["--think-ms", "empty item"]),
    (["--context", "5"], ["--context", "5"]),
    (["--rounds", "0"], ["--rounds", "0"]),
    (["--device-budget", "5"], ["device_budget=5"]),
    (["--host-budget", "2.5"], ["host_budget=2.5"]),
])
def test_bench_resume_bad_options(args, words):
    assert_one_line(run("bench", "resume", *args), 2, *words)


@pytest.mark.parametrize("args, words", [
    (["--plan-recall", "device,gpu"], ["--plan-recall", "'gpu'", "'device', 'host'"]),
    (["--host-budget", "2.5"], ["host_budget=2.5"]),
    (["--host-budget", "abc"], ["--host-budget", "'abc'"]),
])
def test_bench_launches_bad_options(args, words):
    assert_one_line(run("bench", "launches", *args), 2, *words)


def test_bench_json_failure():
    assert_json_error(run("bench", "decode", "--rounds", "0", "--json"), 2, "--rounds")


# ----------------------------------------------------------------------------------------------------- eval

@pytest.mark.parametrize("args, words", [
    (["--budgets", "abc"], ["--budgets", "'abc'", "allowed"]),
    (["--budgets", "5"], ["--budgets", "'5'", "(0, 1]"]),
    (["--budgets", "0"], ["--budgets"]),
    (["--budgets", "nan"], ["--budgets"]),
    (["--budgets", "0.1,,0.2"], ["--budgets", "empty"]),
    (["--budgets", "0.1,x"], ["--budgets", "'x'"]),
    (["--lengths", "abc"], ["--lengths", "'abc'"]),
    (["--lengths", "0"], ["--lengths", "'0'"]),
    (["--lengths", "-100"], ["--lengths"]),
    (["--seed", "x"], ["--seed", "'x'"]),
    (["--seed", "-1"], ["--seed"]),
    (["--policies", "bogus"], ["--policies", "'bogus'", "tier:<scorer>"]),
    (["--policies", "evict:nope"], ["--policies", "'nope'", "keynorm"]),
    (["--policies", ""], ["--policies"]),
    (["--tasks", "nope"], ["--tasks", "'nope'", "perplexity"]),
    (["--threads", "0"], ["--threads"]),
    (["--suite", "nope"], ["--suite", "quick"]),
])
def test_eval_bad_options(args, words, tmp_path):
    assert_one_line(run("eval", "--out", tmp_path / "r.jsonl", *args), 2, *words)


def test_eval_out_is_checked_before_loading(tmp_path):
    assert_one_line(run("eval", "--out", tmp_path), 2, "--out", "is a folder")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task": "niah_single"}\n{oops\n')
    assert_one_line(run("eval", "--out", bad), 2, str(bad), "line 1")
    assert_json_error(run("eval", "--out", bad, "--json"), 2, str(bad))


# --------------------------------------------------------------------------------------------------- report

GOOD = {"task": "niah_single", "length": 1024, "seed": 0, "policy": "full", "budget": 1.0, "score": 1.0,
        "output": "x"}


def test_report_malformed_jsonl_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(GOOD) + "\n{not json\n")
    assert_one_line(run("report", bad, "--out", tmp_path / "r.md"), 2, str(bad), "line 4", "JSON")
    assert not (tmp_path / "r.md").exists()


def test_report_records_without_result_fields(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n[1, 2]\n")
    assert_one_line(run("report", bad, "--out", tmp_path / "r.md"), 2, str(bad), "line 2")
    bad.write_text(json.dumps({k: v for k, v in GOOD.items() if k != "policy"}) + "\n")
    assert_one_line(run("report", bad, "--out", tmp_path / "r.md"), 2, "line 1", "policy")


def test_report_bad_inputs(tmp_path):
    assert_one_line(run("report", tmp_path / "missing.jsonl"), 2, "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_one_line(run("report", empty), 2, "no results")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    assert_one_line(run("report", binary), 2, "binary.jsonl")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(GOOD) + "\n")
    assert_one_line(run("report", good, "--out", tmp_path), 2, "--out", "is a folder")
    if os.path.isdir("/proc"):
        assert_one_line(run("report", good, "--out", "/proc/nope/r.md"), 2, "--out", "/proc/nope/r.md")


# ----------------------------------------------------------------------------------- traces, train, eval-scorer

def test_train_and_eval_scorer_on_a_folder_without_traces(tmp_path):
    assert_one_line(run("train", "--traces", tmp_path, "--out", tmp_path / "w.safetensors"), 2,
                    "--traces", str(tmp_path), "no traces")
    assert_one_line(run("eval-scorer", "--traces", tmp_path), 2, "--traces", "no traces")
    assert_json_error(run("eval-scorer", "--traces", tmp_path, "--json"), 2, "--traces")


def test_trace_folder_with_a_damaged_manifest(tmp_path):
    (tmp_path / "manifest.json").write_text("{oops")
    assert_one_line(run("eval-scorer", "--traces", tmp_path), 2, "--traces", "manifest.json")
    (tmp_path / "manifest.json").write_text(json.dumps({"model": "m", "num_layers": 1, "num_kv_heads": 1,
                                                        "head_dim": 8, "traces": []}))
    assert_one_line(run("train", "--traces", tmp_path, "--out", tmp_path / "w.safetensors"), 2, "no traces")
    (tmp_path / "manifest.json").write_text(json.dumps({"model": "m", "num_layers": 1, "num_kv_heads": 1,
                                                        "head_dim": 8, "traces": [{"file": "t0.safetensors"}]}))
    assert_one_line(run("train", "--traces", tmp_path, "--out", tmp_path / "w.safetensors"), 2, "t0.safetensors")


@pytest.fixture
def trace_dir(tmp_path):
    """A folder that passes the manifest check (its trace file is a placeholder, never read by these tests)."""
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "t0.safetensors").write_bytes(b"")
    (folder / "manifest.json").write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "num_layers": 30,
                                                      "num_kv_heads": 3, "head_dim": 64,
                                                      "traces": [{"file": "t0.safetensors"}]}))
    return folder


@pytest.mark.parametrize("args, words", [
    (["--budgets", "abc"], ["--budgets", "'abc'"]),
    (["--budgets", "0"], ["--budgets", "(0, 1]"]),
    (["--budgets", "0.1,2"], ["--budgets", "'2'"]),
    (["--kvp", "/no/such/weights.safetensors"], ["--kvp"]),
    (["--importance", "nope"], ["--importance", "importance_next"]),
])
def test_eval_scorer_bad_options(trace_dir, args, words):
    assert_one_line(run("eval-scorer", "--traces", trace_dir, *args), 2, *words)


def test_eval_scorer_markdown_in_a_folder(trace_dir, tmp_path):
    assert_one_line(run("eval-scorer", "--traces", trace_dir, "--markdown", tmp_path), 2, "--markdown", "folder")


@pytest.mark.parametrize("args, words", [
    (["--steps", "0"], ["--steps"]),
    (["--threads", "0"], ["--threads"]),
    (["--seed", "-1"], ["--seed"]),
    (["--objective", "nope"], ["--objective"]),
    (["--importance", "nope"], ["--importance", "importance_decay"]),
    (["--lr", "0"], ["--lr"]),
    (["--lr", "abc"], ["--lr"]),
    (["--age-only", "/nonexistent/w.safetensors"], ["--age-only"]),
])
def test_train_bad_options(trace_dir, tmp_path, args, words):
    assert_one_line(run("train", "--traces", trace_dir, "--out", tmp_path / "w.safetensors", *args), 2, *words)


def test_train_out_is_a_folder(trace_dir, tmp_path):
    assert_one_line(run("train", "--traces", trace_dir, "--out", tmp_path), 2, "--out")


@pytest.mark.parametrize("args, words", [
    (["--texts", "0", "--needles", "0"], ["--needles", "nothing to record"]),
    (["--texts", "-1"], ["--texts"]),
    (["--prompt-tokens", "0"], ["--prompt-tokens"]),
    (["--continuation-tokens", "0"], ["--continuation-tokens"]),
    (["--needle-context", "10"], ["--needle-context"]),
    (["--needle-context", "2048,x"], ["--needle-context", "'x'"]),
    (["--chats", "-1"], ["--chats"]),
    (["--chat-context", "100"], ["--chat-context"]),
    (["--threads", "0"], ["--threads"]),
    (["--split", "test"], ["--split"]),
])
def test_traces_bad_options(tmp_path, args, words):
    assert_one_line(run("traces", "--out", tmp_path / "t", *args), 2, *words)
    assert not (tmp_path / "t").exists()


def test_traces_out_not_writable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_one_line(run("traces", "--out", blocker / "t"), 2, "--out", "not a writable folder")


# ------------------------------------------------------------------------------------------------ --model

def test_model_folder_without_a_model(tmp_path):
    assert_one_line(run("demo", "--model", tmp_path), 2, "--model", str(tmp_path), "no config.json")
    (tmp_path / "m.gguf").write_bytes(b"")
    assert_one_line(run("chat", "--model", tmp_path), 2, "--model", "m.gguf")
    assert_json_error(run("bench", "decode", "--model", tmp_path, "--json"), 2, "--model")


def test_model_path_that_is_not_a_model(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    assert_one_line(run("demo", "--model", f), 2, "--model", "not a .gguf")
    assert_one_line(run("traces", "--out", tmp_path / "t", "--model", tmp_path / "missing"), 2, "--model",
                    "neither a local path")
    assert_one_line(run("eval", "--out", tmp_path / "r.jsonl", "--model", "/no/such/model"), 2, "--model")


def test_model_that_fails_to_load_is_one_line(tmp_path, monkeypatch):
    """A folder that looks like a model but does not load: the loader's error becomes one line, exit 2."""
    import kvtier.models

    def broken(*args, **kwargs):
        raise OSError(f"Error no file named model.safetensors found in directory {tmp_path}.")

    monkeypatch.setattr(kvtier.models, "_load", broken)
    (tmp_path / "config.json").write_text("{}")
    assert_one_line(run("demo", "--model", tmp_path, "--needles", "1"), 2, "--model", str(tmp_path),
                    "model.safetensors")
    assert_json_error(run("demo", "--model", tmp_path, "--json"), 2, "--model")


# -------------------------------------------------------------------------------------------------- --device

@pytest.mark.parametrize("command", ["demo", "demo --synthetic", "chat", "eval"])
@pytest.mark.parametrize("value, words", [
    ("cuda:99", ["'cuda:99'", "is not available"]),
    ("mps", ["'mps'", "is not supported", "auto, cpu, cuda, cuda:N"]),
    ("gpu", ["'gpu'", "is not a device", "auto, cpu, cuda, cuda:N"]),
])
def test_a_device_that_cannot_run_the_model_is_refused_before_loading(command, value, words, tmp_path):
    args = command.split() + (["--out", tmp_path / "r.jsonl"] if command == "eval" else [])
    assert_one_line(run(*args, "--device", value), 2, "--device", *words)
    assert not (tmp_path / "r.jsonl").exists()


def test_auto_is_the_current_gpu_where_there_is_one(monkeypatch):
    import torch

    from kvtier.cli.common import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)   # indexed, as tensors made on it say
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")


# ------------------------------------------------------------------------------------------------ chat, info

@pytest.mark.parametrize("args, words", [
    (["--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["--threads", "0"], ["--threads"]),
    (["--park", "nope"], ["--park", "'nope'"]),
    (["--device-budget", "0"], ["device_budget=0"]),
    (["--host-budget", "x"], ["--host-budget", "'x'"]),
])
def test_chat_bad_options(args, words):
    assert_one_line(run("chat", *args), 2, *words)
    assert_json_error(run("chat", *args, "--json"), 2, *words)


def test_info_disk_dir(tmp_path):
    if os.path.isdir("/proc"):
        assert_json_error(run("info", "--disk-dir", "/proc/nope", "--json"), 2, "--disk-dir")
    later = tmp_path / "not" / "yet"
    result = run("info", "--disk-dir", later, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["disk"]["folder"] == str(later)
    assert not (tmp_path / "not").exists()


# ------------------------------------------------------------------------------------------- click's errors

@pytest.mark.parametrize("args, words", [
    (["demo", "--contxt", "5"], ["--contxt"]),
    (["demo", "--context"], ["--context", "requires an argument"]),
    (["nope"], ["nope"]),
    (["bench", "nope"], ["nope"]),
    (["report"], ["RESULTS"]),
    (["traces"], ["--out"]),
])
def test_click_usage_errors_are_one_line(args, words):
    assert_one_line(run(*args), 2, *words)


def test_usage_error_with_json_prints_json():
    assert_json_error(run("demo", "--json", "--bogus"), 2, "--bogus")


def test_help_still_works():
    result = run("--help")
    assert result.exit_code == 0 and "Usage:" in result.output
    result = run("demo", "--help")
    assert result.exit_code == 0 and "--disk-dir" in result.output
    result = run()
    assert "Commands:" in result.output and "Traceback" not in result.output


# ------------------------------------------------------------------------------------------- runtime failures

GPU_FULL = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
            "1.02 GiB is free. Of the allocated memory 137.1 GiB is allocated by PyTorch. If reserved but unallocated "
            "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


CPU_FULL = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
            "allocate 38654705664 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), "capacity", "gpu", "cpu"])
def test_failure_while_running_exits_3(monkeypatch, error):
    import torch

    import kvtier.bench.synthetic as synthetic
    from kvtier.errors import CapacityError

    exc = {"capacity": CapacityError("disk tier full: 0 bytes free in /x"),
           "gpu": torch.OutOfMemoryError(GPU_FULL), "cpu": RuntimeError(CPU_FULL)}.get(error, error)

    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(synthetic, "synthetic_needles", fail)
    word = {"capacity": "CapacityError", "gpu": "out of device memory (CUDA out of memory. Tried to allocate 2.00 "
            "GiB)", "cpu": "out of memory (DefaultCPUAllocator: can't allocate memory: you tried to allocate "
            "38654705664 bytes"}.get(error, "No space left")
    assert_one_line(run("demo", "--synthetic", "--context", "4K"), 3, word)
    assert_json_error(run("demo", "--synthetic", "--context", "4K", "--json"), 3, word)


def test_real_entry_point_prints_one_line():
    """Through `python -m kvtier` (sys.argv, not the test runner): one line on stderr, nothing else, exit 2."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "kvtier", "bench", "decode", "--rounds", "0", "--json"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["kvtier: error: Invalid value for '--rounds': 0 is not in the "
                                                "range x>=1."]
    assert json.loads(proc.stdout) == {"error": "Invalid value for '--rounds': 0 is not in the range x>=1.",
                                       "exit_code": 2}


@pytest.mark.parametrize("args, words", [
    (["--slopes", "abc"], ["--slopes", "'abc'", "allowed"]),
    (["--slopes", "1,-2"], ["--slopes", ">= 0"]),
    (["--slopes", "nan"], ["--slopes"]),
    (["--lengths", "32"], ["--lengths", "'32'"]),
    (["--budgets", "2"], ["--budgets", "(0, 1]"]),
    (["--texts", "0"], ["--texts"]),
    (["--needle-context", "100"], ["--needle-context", "'100'"]),
])
def test_calibrate_bad_options(tmp_path, args, words):
    from kvtier.scoring.kvp import shipped_path

    out = tmp_path / "w.safetensors"
    assert_one_line(run("calibrate", "--kvp", str(shipped_path("SmolLM2-135M-Instruct")), "--out", str(out), *args),
                    2, *words)
    assert not out.exists()


def test_calibrate_weights_for_another_model(tmp_path):
    from kvtier.scoring.kvp import KVPAgents, save_agents

    weights = tmp_path / "toy.safetensors"
    save_agents(KVPAgents(4, 16, hidden=8), weights, {"model": "toy", "num_layers": 2, "num_kv_heads": 2,
                                                      "head_dim": 16})
    out = tmp_path / "w.safetensors"
    assert_one_line(run("calibrate", "--kvp", weights, "--out", out), 2, "trained for 2 layers x 2 KV heads",
                    "30 x 3 x 64")
    assert not out.exists()


def test_a_reader_that_stops_reading_gets_no_error_message():
    """`kvtier info | head -1`: stdout closed by its reader is no failure to report; exit 1, nothing on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)   # every write to stdout now fails with a broken pipe
    try:
        done = subprocess.run([sys.executable, "-m", "kvtier", "info"], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 1, done.stderr
    assert "error" not in done.stderr.lower() and "Traceback" not in done.stderr, done.stderr


def test_the_command_knows_when_it_started_only_when_it_is_the_process(monkeypatch):
    """`kvtier bench gpu`'s start-up counts in its five minutes only where the process is the command itself."""
    from kvtier.cli.common import command_started

    monkeypatch.setattr(sys, "argv", ["/usr/lib/python3/site-packages/pytest/__main__.py", "-q"])
    assert command_started() is None
    monkeypatch.setattr(sys, "argv", ["/home/me/kvtier/.venv/lib/site-packages/pytest/__main__.py", "-q"])
    assert command_started() is None   # a test runner inside a checkout named kvtier is still not the command
    monkeypatch.setattr(sys, "argv", ["/venv/bin/kvtier", "bench", "gpu"])
    import psutil

    assert command_started() == psutil.Process().create_time()
    monkeypatch.setattr(sys, "argv", ["/src/kvtier/__main__.py", "bench", "gpu"])
    assert command_started() == psutil.Process().create_time()


@pytest.mark.parametrize("args", [[], ["bench"]])
def test_a_group_alone_shows_its_help(args):
    """No command: the group's help, as click shows it, exit 2, never a traceback."""
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Usage:" in result.output and "Commands:" in result.output
    assert "Traceback" not in result.output
