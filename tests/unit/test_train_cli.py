"""`kvtier train` end to end on a small synthetic trace folder, and `--age-only` on what it wrote."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from kvtier.cli import main
from kvtier.scoring.kvp import load_agents


def _folder(tmp_path, traces=4, layers=2, heads=2, dim=8, name="traces", model="toy"):
    folder = tmp_path / name
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    items = []
    for i, n in enumerate([96, 160] * (traces // 2)):
        keys = torch.randn(layers, heads, n, dim, generator=g)
        ages = torch.arange(n - 1, -1, -1).float()
        save_file({"keys": keys.half(), "values": torch.randn(layers, heads, n, dim, generator=g).half(),
                   "positions": torch.arange(n), "importance": torch.exp(-ages / 16).expand(layers, heads, n).contiguous()},
                  str(folder / f"t{i}.safetensors"))
        items.append({"file": f"t{i}.safetensors", "continuation": "text"})
    (folder / "manifest.json").write_text(json.dumps({
        "model": model, "num_layers": layers, "num_kv_heads": heads, "head_dim": dim, "corpus": "synthetic",
        "traces": items}))
    return folder


def _train(*args):
    return CliRunner().invoke(main, ["train", *map(str, args), "--threads", "1"])


def test_train_then_train_the_recency_term_alone(tmp_path):
    folder = _folder(tmp_path)
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    result = _train("--traces", folder, "--out", first, "--steps", 5)
    assert result.exit_code == 0, result.output
    result = _train("--traces", folder, "--out", second, "--steps", 20, "--lr", 0.05, "--age-only", first)
    assert result.exit_code == 0, result.output
    (a, meta_a), (b, meta_b) = load_agents(first), load_agents(second)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y) == (name != "age"), name      # only the recency table was trained
    assert meta_b["model"] == "toy" and meta_b["best_step"] == meta_a["best_step"]   # the network's record stays
    assert meta_b["age_term"]["settings"]["lr"] == 0.05 and "synthetic" in meta_b["age_term"]["trained_on"]


def test_age_only_drops_the_calibration_record_of_the_term_it_retrains(tmp_path):
    from kvtier.scoring.kvp import save_agents

    folder = _folder(tmp_path)
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    result = _train("--traces", folder, "--out", first, "--steps", 3)
    assert result.exit_code == 0, result.output
    agents, meta = load_agents(first)
    save_agents(agents, first, {**meta, "calibration": {"slope": 2.0}})
    result = _train("--traces", folder, "--out", second, "--steps", 3, "--age-only", first)
    assert result.exit_code == 0, result.output
    assert "calibration" not in load_agents(second)[1] and load_agents(first)[1]["calibration"] == {"slope": 2.0}


def test_train_on_several_folders_of_one_model(tmp_path):
    a, b = _folder(tmp_path, name="a"), _folder(tmp_path, name="b")
    out = tmp_path / "w.safetensors"
    result = _train("--traces", a, "--traces", b, "--out", out, "--steps", 2)
    assert result.exit_code == 0, result.output
    assert load_agents(out)[1]["training_data"].startswith("8 traces from a, b ")


def test_folders_of_one_model_recorded_under_two_names_train_together(tmp_path):
    """A model is known by its sizes: folders of one model recorded under its id and its local path train together."""
    a, b = _folder(tmp_path, name="a"), _folder(tmp_path, name="b", model="/models/toy")
    result = _train("--traces", a, "--traces", b, "--out", tmp_path / "w.safetensors", "--steps", 2)
    assert result.exit_code == 0, result.output


def test_train_refuses_folders_of_different_models(tmp_path):
    a, b = _folder(tmp_path, name="a"), _folder(tmp_path, name="b", heads=3)
    result = _train("--traces", a, "--traces", b, "--out", tmp_path / "w.safetensors", "--steps", 2)
    assert result.exit_code == 2
    assert "--traces" in result.output and "num_kv_heads=3" in result.output and "one model" in result.output
    assert not (tmp_path / "w.safetensors").exists()


def test_age_only_refuses_weights_of_another_model(tmp_path):
    """`--age-only` weights of another model (4 layers of 1 KV head against the traces' 2 of 2) are refused by
    name before any training; they had trained, and the file written claimed the other model."""
    from kvtier.scoring.kvp import KVPAgents, save_agents

    folder, other = _folder(tmp_path), tmp_path / "other.safetensors"
    save_agents(KVPAgents(4, 8, hidden=16), other, {"model": "other-model", "num_layers": 4, "num_kv_heads": 1,
                                                    "head_dim": 8})
    result = _train("--traces", folder, "--out", tmp_path / "w.safetensors", "--steps", 3, "--age-only", other)
    assert result.exit_code == 2 and "--age-only" in result.output
    assert "'other-model'" in result.output and "num_layers=4" in result.output and "num_layers=2" in result.output
    assert not (tmp_path / "w.safetensors").exists()


def test_train_refuses_more_top_tokens_than_a_problem_holds(tmp_path):
    folder = _folder(tmp_path)
    result = _train("--traces", folder, "--out", tmp_path / "w.safetensors", "--top-tokens", 500)
    assert result.exit_code == 2
    assert "--top-tokens" in result.output and "top_tokens=500" in result.output and "384" in result.output
    assert not (tmp_path / "w.safetensors").exists()


def test_out_with_a_tilde_is_written_where_it_was_checked(tmp_path, monkeypatch):
    """`--out=~/x` reaches the program unexpanded (the shell expands no ~ after '='): the checks expanded it, and
    training then wrote to a folder named '~' under the current one, failing after it had trained."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    folder = _folder(tmp_path)
    result = _train("--traces", folder, "--out=~/kvp/w.safetensors", "--steps", 2)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "home" / "kvp" / "w.safetensors").is_file() and not (tmp_path / "~").exists()
    assert (tmp_path / "home" / "kvp" / "w.report.json").is_file()


@pytest.mark.parametrize("model, sizes", [
    ("/models/SmolLM2-135M-Instruct.gguf", {"hidden_size": 576, "vocab_size": 49152}), ("SmolLM2-135M-Instruct", {})])
def test_eval_scorer_finds_the_shipped_weights_by_name_or_by_the_model_s_sizes(tmp_path, model, sizes):
    """Traces of the default model recorded under its file's path had been refused ("no KVP weights ship"); a
    manifest that records no sizes is still matched by its name."""
    folder = tmp_path / "eval"
    folder.mkdir()
    layers, heads, dim, n = 30, 3, 64, 80
    g = torch.Generator().manual_seed(0)
    raw = {"keys": torch.randn(layers, heads, n, dim, generator=g).half(),
           "values": torch.randn(layers, heads, n, dim, generator=g).half(), "positions": torch.arange(n),
           "importance": torch.rand(layers, heads, n, generator=g)}
    for name in ("tova", "snapkv", "h2o"):
        raw[name] = torch.rand(layers, heads, n, generator=g)
    save_file(raw, str(folder / "t0.safetensors"))
    (folder / "manifest.json").write_text(json.dumps({
        "model": model, "num_layers": layers, "num_kv_heads": heads, "head_dim": dim, **sizes, "split": "eval",
        "corpus": "synthetic", "traces": [{"file": "t0.safetensors", "continuation": "text"}]}))
    result = CliRunner().invoke(main, ["eval-scorer", "--traces", str(folder), "--budgets", "0.5", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output[result.output.index("{"):])["kvp"]["model"] == "SmolLM2-135M-Instruct"
