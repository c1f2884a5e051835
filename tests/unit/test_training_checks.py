"""What training and the scorers refuse or get right at their edges: settings out of range, traces that are not
finite, folders of the wrong split or given twice, a recording cut short, malformed weights metadata, a batch of
several sequences, positions rewritten in inference mode, SnapKV's pooling at a write's edges, and the trace's
importance under an attention logit cap. Each had been accepted, or had given another answer with no error."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from kvtier.cli import main
from kvtier.errors import ConfigError, ScorerError
from kvtier.training.train import TrainSettings


@pytest.mark.parametrize("field, value, words", [
    ("steps", -5, "steps=-5 is not allowed; allowed: a whole number >= 1"), ("steps", 0, "steps=0"),
    ("batch_traces", 0, "batch_traces=0"), ("tokens_per_trace", 0, "tokens_per_trace=0"),
    ("eval_every", 0, "eval_every=0"), ("hidden", 2.0, "hidden=2.0"), ("warmup", -1, "warmup=-1"),
    ("lr", -1.0, "lr=-1.0; allowed: a finite number > 0"), ("lr", float("nan"), "lr=nan"),
    ("val_share", 1.0, "val_share=1.0; allowed: a finite number > 0 and < 1"), ("val_share", 0.0, "val_share=0.0"),
    ("weight_decay", -0.1, "weight_decay=-0.1; allowed: a finite number >= 0"), ("samples", 1, "samples=1"),
    ("seed", 2**64, "seed=18446744073709551616; allowed: 0 to 2\\*\\*64 - 1")])
def test_train_settings_are_checked_by_name(field, value, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        TrainSettings(**{field: value})


def _folder(tmp_path: Path, name: str, split: str | None = "train", huge: bool = False) -> Path:
    """A small trace folder of a toy model (2 layers, 2 KV heads, head size 8), recorded from `split`."""
    folder = tmp_path / name
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    items = []
    for i, n in enumerate([96, 160, 96, 160]):
        keys = torch.randn(2, 2, n, 8, generator=g)
        if huge and i == 1:
            keys[0, 0, 5, 0] = 70000.0   # past float16's range: inf once stored
        ages = torch.arange(n - 1, -1, -1).float()
        save_file({"keys": keys.half(), "values": torch.randn(2, 2, n, 8, generator=g).half(),
                   "positions": torch.arange(n), "importance": torch.exp(-ages / 16).expand(2, 2, n).contiguous()},
                  str(folder / f"t{i}.safetensors"))
        items.append({"file": f"t{i}.safetensors", "continuation": "text"})
    manifest = {"model": "toy", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "corpus": "synthetic",
                "traces": items}
    if split is not None:
        manifest["split"] = split
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _train(*args):
    return CliRunner().invoke(main, ["train", *map(str, args), "--steps", "2", "--threads", "1"])


def test_traces_that_are_not_finite_are_refused_by_name(tmp_path):
    """A float16 key past 65,504 had trained every weight to NaN, and the NaN weights were kept as the best."""
    out = tmp_path / "w.safetensors"
    result = _train("--traces", _folder(tmp_path, "t", huge=True), "--out", out)
    assert result.exit_code == 2 and "t1.safetensors: its keys hold values that are not finite" in result.output
    assert not out.exists()


def test_train_and_eval_scorer_take_their_own_split(tmp_path):
    result = _train("--traces", _folder(tmp_path, "held", split="eval"), "--out", tmp_path / "w.safetensors")
    assert result.exit_code == 2 and "was recorded from the 'eval' split" in result.output
    assert "--split train" in result.output
    result = CliRunner().invoke(main, ["eval-scorer", "--traces", str(_folder(tmp_path, "train", split="train"))])
    assert result.exit_code == 2 and "was recorded from the 'train' split" in result.output
    assert _train("--traces", _folder(tmp_path, "old", split=None), "--out", tmp_path / "x.safetensors").exit_code == 0


def test_a_folder_given_twice_is_refused(tmp_path):
    """Its traces would have been both trained on and held out (the held-out reward then chose on training data)."""
    folder = _folder(tmp_path, "t")
    result = _train("--traces", folder, "--traces", tmp_path / "." / "t", "--out", tmp_path / "w.safetensors")
    assert result.exit_code == 2 and "is given twice" in result.output and "each folder once" in result.output


def test_a_recording_cut_short_leaves_no_manifest_of_the_last_one(tmp_path, monkeypatch):
    """Recording again into a folder and stopping midway: the old manifest had listed shards now partly the new
    run's (of the other split), and training read them as its own."""
    import kvtier.training.collect as collect

    monkeypatch.setattr(collect, "text_chunks", lambda tok, split, *a, **k: [
        (f"{split}-{i}", torch.full((1, 8), i), torch.full((1, 4), i)) for i in range(4)])
    monkeypatch.setattr(collect, "needle_tasks", lambda *a, **k: [])
    monkeypatch.setattr(collect, "conversations", lambda *a, **k: [])
    made = []

    def record(model, prompt, continuation):
        made.append(1)
        if model.stop_at is not None and len(made) >= model.stop_at:
            raise KeyboardInterrupt
        return {"keys": torch.zeros(1, 1, 8, 4)}

    monkeypatch.setattr(collect, "record_trace", record)
    cfg = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=4, hidden_size=4, vocab_size=10,
                          num_attention_heads=1)

    def model(stop_at):
        return SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: cfg), stop_at=stop_at)

    out = tmp_path / "traces"
    settings = dict(model_name="toy", texts=4, needles=0, prompt_tokens=8, continuation_tokens=4,
                    needle_context=256, answer_tokens=4, seed=0)
    collect.record_folder(model(None), None, out, split="train", **settings)
    assert json.loads((out / "manifest.json").read_text())["split"] == "train"
    made.clear()
    with pytest.raises(KeyboardInterrupt):
        collect.record_folder(model(3), None, out, split="eval", **settings)
    assert not (out / "manifest.json").exists() and not (out / "manifest.json.partial").exists()


@pytest.mark.parametrize("meta, words", [
    ({"num_layers": 1, "num_kv_heads": 1, "head_dim": 8}, "hidden=None"),
    ({"num_layers": "1", "num_kv_heads": 1, "head_dim": 8, "hidden": 8}, "num_layers='1'"),
    ({"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "hidden": -4}, "hidden=-4")])
def test_weights_metadata_is_checked_by_name(tmp_path, meta, words):
    from kvtier.scoring.kvp import load_agents

    path = tmp_path / "w.safetensors"
    save_file({"w1": torch.zeros(1)}, str(path), metadata={"kvtier": json.dumps({"format_version": 1, **meta})})
    with pytest.raises(ConfigError, match=f"w.safetensors' describes its agents with .*{words}.*allowed: whole"):
        load_agents(path)


@pytest.mark.parametrize("name", ["kvp", "tova", "snapkv", "h2o"])
def test_a_batch_of_several_sequences_is_refused(name):
    """KVP and the attention scorers read the first sequence only: the others had been dropped."""
    from kvtier.scoring import make_scorer

    scorer = make_scorer(name)
    k = torch.randn(2, 3, 10, 64)
    query = dict(query=torch.randn(2, 9, 10, 64), context_keys=k, scaling=0.125) if name != "kvp" else {}
    with pytest.raises(ScorerError, match="scores one sequence at a time; got a batch of 2; allowed: batch size 1"):
        scorer.score(k, k, torch.arange(10), 0, **query)


def test_kvp_reads_positions_rewritten_in_inference_mode():
    from kvtier.scoring.kvp import KVPScorer

    scorer = KVPScorer()
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 3, 1, 64, generator=g), torch.randn(1, 3, 1, 64, generator=g)
    with torch.inference_mode():
        pos = torch.zeros(1, dtype=torch.int64)
        pos.fill_(5)
        scorer.score(k, v, pos, 0)
        pos.fill_(5000)   # the next step: the same tensor, another position (it has no version to tell by)
        assert torch.equal(scorer.score(k, v, pos, 0), KVPScorer().score(k, v, torch.tensor([5000]), 0))


def test_snapkv_pools_the_votes_there_are():
    """A one-entry write (a decode step) had scored its votes divided by the kernel width: the zero padding was
    averaged in, at every write's edges."""
    from kvtier.scoring.attention_stats import received_attention
    from kvtier.scoring.snapkv import SnapKVScorer

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 64, 16, generator=g), torch.randn(1, 2, 64, 16, generator=g)
    one = SnapKVScorer().score(k[:, :, -1:], k[:, :, -1:], torch.tensor([63]), 0, query=q[:, :, -1:],
                               context_keys=k, scaling=0.25)
    votes = received_attention(q[:, :, -1:], k, 1, 0.25).sum(2).mean(1)
    torch.testing.assert_close(one[0], votes)


def test_trace_importance_is_the_capped_attention_the_model_computes():
    """Gemma 2 caps its attention logits (softcap): the training target had been the uncapped attention."""
    from kvtier.training.traces import future_importance

    g = torch.Generator().manual_seed(0)
    prompt, steps = 20, 6
    q, k = torch.randn(1, 4, steps, 8, generator=g) * 3, torch.randn(1, 2, prompt + steps, 8, generator=g) * 3
    cap, scaling = 2.0, 8 ** -0.5
    got = future_importance(q, k, scaling, prompt, softcap=cap)["importance"]
    logits = torch.einsum("hgqd,hkd->hgqk", q[0].view(2, 2, steps, 8), k[0]) * scaling
    logits = cap * torch.tanh(logits / cap)
    visible = torch.arange(prompt + steps)[None, :] <= (prompt + torch.arange(steps))[:, None]
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)[..., :prompt]
    torch.testing.assert_close(got, probs.amax(dim=1).sum(dim=1))


def test_a_held_out_share_that_would_take_every_trace_leaves_one_to_train_on(tmp_path):
    """Two traces and val_share=0.75: the held-out count rounded up to both, and training failed deep inside
    (torch.cat of nothing); one trace is now always left to train on."""
    from kvtier.training.dataset import load_folder
    from kvtier.training.train import train_agents

    _, traces = load_folder(_folder(tmp_path, "t"))
    agents, report = train_agents(traces[:2], 8, TrainSettings(steps=2, eval_every=1, val_share=0.75))
    assert report["best_step"] >= 0


def test_shards_of_another_shape_than_their_manifest_are_refused_by_name(tmp_path):
    """Shards of 1 layer x 4 KV heads under a manifest of 2 x 2 (as many networks) had trained, and the weights,
    claiming 2 x 2, gave layer 1's heads the networks learned for layer 0's."""
    folder = _folder(tmp_path, "t")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.update(num_layers=1, num_kv_heads=4)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    result = _train("--traces", folder, "--out", tmp_path / "w.safetensors")
    assert result.exit_code == 2 and "t0.safetensors" in result.output
    assert "2 layers x 2 KV heads x head size 8" in result.output and "1 x 4 x 8" in result.output


def test_a_damaged_trace_shard_is_named_in_a_one_line_error(tmp_path):
    folder = _folder(tmp_path, "t")
    shard = folder / "t1.safetensors"
    shard.write_bytes(shard.read_bytes()[:200])
    result = _train("--traces", folder, "--out", tmp_path / "w.safetensors")
    assert result.exit_code == 2 and "t1.safetensors: not a readable trace shard" in result.output
    assert "Traceback" not in result.output


def test_a_run_cut_short_leaves_no_out_folder(tmp_path, monkeypatch):
    import kvtier.training.train as train_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "train_agents", interrupted)
    result = _train("--traces", _folder(tmp_path, "t"), "--out", tmp_path / "new" / "dir" / "w.safetensors")
    assert result.exit_code != 0 and not (tmp_path / "new").exists()


def test_a_full_disk_while_saving_weights_is_an_os_error_naming_the_file(tmp_path, monkeypatch):
    """safetensors raises its own error, not an `OSError`: the command line took a full disk for a bug (a
    traceback, exit 1) where its contract is one line and exit 3."""
    import errno

    from safetensors import SafetensorError

    import kvtier.outputs as outputs

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(outputs, "save_file", full)
    with pytest.raises(OSError) as got:
        outputs.save_tensors({"x": torch.zeros(2)}, tmp_path / "w.safetensors")
    assert got.value.errno == errno.ENOSPC and "w.safetensors" in str(got.value)
    result = _train("--traces", _folder(tmp_path, "t"), "--out", tmp_path / "w.safetensors")
    assert result.exit_code == 3 and "No space left on device" in result.output and "Traceback" not in result.output
