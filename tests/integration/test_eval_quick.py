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
