"""The quick evaluation suite: tier mode with full recall must give the full cache's answers."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvtier.cli import main
from kvtier.eval.report import write_report
from kvtier.eval.runner import SUITES, full_recall_mismatches, read_results, run_suite

pytestmark = pytest.mark.slow


def test_quick_suite_full_recall_matches_and_resumes(default_model, tmp_path):
    model, tok = default_model
    out = tmp_path / "quick.jsonl"
    results = run_suite(model, tok, out, SUITES["quick"])
    assert len(results) == 3 * 4  # 3 tasks x (full + 3 policies at one budget)
    assert full_recall_mismatches(results) == []
    full = {r["task"]: r for r in results if r["policy"] == "full"}
    assert full["niah_single"]["score"] == 1.0  # the model can do it, so the table means something
    tier = {r["task"]: r for r in results if r["policy"] == "tier:kvp"}
    evict = {r["task"]: r for r in results if r["policy"] == "evict:kvp"}
    assert tier["perplexity"]["ppl"] < evict["perplexity"]["ppl"]  # recall beats eviction at 10%
    again = run_suite(model, tok, out, SUITES["quick"])  # resumed: nothing new is run
    assert len(again) == len(results) == len(read_results(out))
    png = write_report(results, tmp_path / "results.md", command="test")
    assert png.exists() and "### perplexity" in (tmp_path / "results.md").read_text()


def test_mismatch_detection():
    rows = [{"task": "t", "length": 1, "seed": 0, "policy": "full", "budget": 1.0, "output": "42", "ppl": None},
            {"task": "t", "length": 1, "seed": 0, "policy": "tier-all:kvp", "budget": 0.1, "output": "41", "ppl": None}]
    assert len(full_recall_mismatches(rows)) == 1
    rows[1]["output"] = "42"
    assert full_recall_mismatches(rows) == []


def test_eval_cli_rejects_bad_policy():
    result = CliRunner().invoke(main, ["eval", "--policies", "full,drop:kvp"])
    assert result.exit_code == 2 and "policy 'drop:kvp'" in result.output


def test_eval_cli_json(tmp_path):
    result = CliRunner().invoke(main, ["eval", "--suite", "quick", "--tasks", "niah_single", "--policies",
                                       "full,tier-all:kvp", "--out", str(tmp_path / "r.jsonl"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert data["runs"] == 2 and data["full_recall_mismatches"] == []


def test_a_resumed_example_whose_prompt_changed_is_run_again(default_model, tmp_path):
    """A results file's full-cache row made on another prompt (the task's text changed since): resuming ran the new
    policy on the new prompt and compared it with that row. The example's rows are made again and stand for it."""
    from kvtier.eval.runner import Suite

    model, tok = default_model
    out = tmp_path / "r.jsonl"
    suite = Suite(("perplexity",), (256,), ("full",), (0.5,), (0,))
    (first,) = run_suite(model, tok, out, suite)
    stale = {**first, "prompt_tokens": first["prompt_tokens"] + 13, "ppl": 99.0}
    stale.pop("prompt_sha")
    out.write_text(json.dumps(stale) + "\n")
    results = run_suite(model, tok, out, Suite(("perplexity",), (256,), ("full", "evict:recency"), (0.5,), (0,)))
    assert len(results) == 2 and len(read_results(out)) == 3
    full = next(r for r in results if r["policy"] == "full")
    assert full["ppl"] == first["ppl"] and full["prompt_sha"] == first["prompt_sha"]


def test_one_policy_written_two_ways_runs_once_and_a_window_over_its_budget_is_refused(default_model, tmp_path):
    from kvtier.errors import ConfigError
    from kvtier.eval.runner import Suite

    model, tok = default_model
    twice = ("evict:recency@64", "evict:recency@064")
    results = run_suite(model, tok, tmp_path / "a.jsonl", Suite(("perplexity",), (256,), twice, (0.5,), (0,)))
    assert [r["policy"] for r in results] == ["evict:recency@64"]
    with pytest.raises(ConfigError, match="policy 'evict:recency@64' at budget 0.1 of 256 tokens keeps 68 tokens"):
        run_suite(model, tok, tmp_path / "b.jsonl", Suite(("perplexity",), (256,), ("evict:recency@64",), (0.1,), (0,)))
    assert not (tmp_path / "b.jsonl").exists()


def test_a_run_interrupted_mid_policy_closes_its_cache(default_model, tmp_path, monkeypatch):
    import kvtier.eval.runner as runner
    from kvtier.eval.runner import Suite

    made = []

    class Tracked(runner.TieredCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "TieredCache", Tracked)
    monkeypatch.setattr(runner, "continuation_nll", interrupted)
    model, tok = default_model
    with pytest.raises(KeyboardInterrupt):
        run_suite(model, tok, tmp_path / "r.jsonl", Suite(("perplexity",), (256,), ("evict:recency",), (0.5,), (0,)))
    assert len(made) == 1 and made[0].closed


def test_eval_cli_names_a_bad_recent_window():
    result = CliRunner().invoke(main, ["eval", "--policies", "full,evict:kvp@1.5"])
    assert result.exit_code == 2 and "the recent window of policy 'evict:kvp@1.5'" in result.output
