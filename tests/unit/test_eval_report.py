"""The report's summary: the comparison and the target checks are computed from the rows, not written by hand."""

from __future__ import annotations

import torch

from kvtier.eval.report import summary_lines
from kvtier.eval.shared_prefill import PromptScores


def _row(task, policy, budget, length=2048, score=None, ppl=None):
    return {"task": task, "length": length, "seed": 0, "policy": policy, "budget": budget, "score": score,
            "ppl": ppl, "output": None if score is None else f"answer {score}"}


def test_summary_compares_policies_and_checks_targets():
    rows = [_row("niah", "full", 1.0, score=1.0), _row("niah", "tier:kvp", 0.1, score=1.0),
            _row("niah", "evict:kvp", 0.1, score=0.5), _row("niah", "evict:keynorm", 0.1, score=0.75),
            _row("niah", "evict:tova", 0.1, score=0.25),
            _row("perplexity", "full", 1.0, ppl=10.0), _row("perplexity", "tier:kvp", 0.1, ppl=10.1),
            _row("perplexity", "evict:kvp", 0.1, ppl=12.0), _row("perplexity", "evict:keynorm", 0.1, ppl=11.0),
            _row("perplexity", "evict:tova", 0.1, ppl=13.0),
            _row("perplexity", "full", 1.0, length=4096, ppl=8.0),
            _row("perplexity", "tier:kvp", 0.1, length=4096, ppl=8.4)]
    text = "\n".join(summary_lines(rows))
    assert "| niah | 100.0 | 100.0 | 50.0 | 75.0 (keynorm) | 25.0 (tova) |" in text
    # the evictions ran the 2,048-token example only, the full cache both: their means are marked
    assert "| perplexity | 9.00 | 9.25 | 12.00* | 11.00* (keynorm) | 13.00* (tova) |" in text
    assert "largest departure from the full cache over the generation tasks is +0.0 points (niah;" in text
    assert "+1.00% at 2048, +5.00% at 4096" in text
    assert "below the full cache's score on 0 of 1, above on 0; the very same answer text on 1." in text
    assert "attention-free scorers by mean accuracy: keynorm 75.0, kvp 50.0." in text


def test_a_perplexity_only_run_and_a_run_without_full_are_reported(tmp_path):
    """`kvtier eval --tasks perplexity` has no generation task to average, and `--policies tier:kvp` no full cache
    to compare with: both are reported (tables and plot), without the parts that need what is missing."""
    from kvtier.eval.report import write_report

    only_ppl = [_row("perplexity", "full", 1.0, ppl=10.0), _row("perplexity", "tier:kvp", 0.1, ppl=10.1)]
    text = "\n".join(summary_lines(only_ppl))
    assert "| perplexity | 10.00 | 10.10 |" in text and "Mean accuracy" not in text
    assert "perplexity +1.00% against the full cache" in text
    no_full = [_row("niah", "tier:kvp", 0.1, score=1.0), _row("perplexity", "tier:kvp", 0.1, ppl=10.1)]
    text = "\n".join(summary_lines(no_full))
    assert "| niah | - | 100.0 |" in text and "against the full cache" not in text
    for i, rows in enumerate((only_ppl, no_full)):
        png = write_report(rows, tmp_path / f"report{i}.md", "kvtier eval")
        assert png.exists() and "## All tables" in (tmp_path / f"report{i}.md").read_text()


class CountingScorer:
    name = "counting"

    def __init__(self):
        self.calls = 0

    def score(self, keys, values, positions, layer_idx):
        self.calls += 1
        return keys[..., 0] + layer_idx


def test_prompt_scores_are_computed_once_per_layer_and_later_writes_afresh():
    inner = CountingScorer()
    shared = PromptScores(inner, prompt_tokens=5)
    k = torch.randn(1, 2, 5, 4)
    first = shared.score(k, k, torch.arange(5), 0)
    again = shared.score(k, k, torch.arange(5), 0)   # a second budget loading the same prompt
    assert again is first and inner.calls == 1
    shared.score(k, k, torch.arange(5), 1)
    assert inner.calls == 2
    step = torch.randn(1, 2, 1, 4)
    torch.testing.assert_close(shared.score(step, step, torch.tensor([5]), 0), step[..., 0])
    assert inner.calls == 3 and shared.name == "counting" and not shared.needs_query


def test_comparisons_with_the_full_cache_are_over_the_examples_both_ran():
    """The full cache ran at 1,024 and 2,048 tokens, tier at 1,024 only (a run cut short, or resumed with other
    lengths): the perplexity and the departure had compared unlike sets (-32.67% where the one matched example
    says +1.00%)."""
    rows = [_row("perplexity", "full", 1.0, length=1024, ppl=10.0), _row("perplexity", "full", 1.0, ppl=20.0),
            _row("perplexity", "tier:kvp", 0.1, length=1024, ppl=10.1),
            _row("niah", "full", 1.0, length=1024, score=0.0), _row("niah", "full", 1.0, score=1.0),
            _row("niah", "tier:kvp", 0.1, length=1024, score=0.0)]
    text = "\n".join(summary_lines(rows))
    assert "perplexity +1.00% against the full cache (mean over the 1 examples both ran; +1.00% at 1024)" in text
    assert "is +0.0 points (niah; over the examples both ran)" in text


def test_the_summary_is_made_at_the_budget_run_nearest_to_10_percent(tmp_path):
    from kvtier.eval.report import write_report

    rows = [_row("niah", "full", 1.0, score=1.0), _row("niah", "tier:kvp", 0.25, score=1.0),
            _row("niah", "tier:kvp", 0.5, score=0.0)]
    write_report(rows, tmp_path / "r.md", "kvtier eval")
    text = (tmp_path / "r.md").read_text()
    assert "## Summary at 25% of the cache on the device" in text and "| niah | 100.0 | 100.0 |" in text


def test_a_results_file_is_mended_before_rows_are_appended(tmp_path):
    """A last line without its newline had the next row glued onto it, and every later read of the file failed."""
    import json

    from kvtier.eval.runner import mend_last_line, read_results

    path = tmp_path / "r.jsonl"
    whole, cut = json.dumps(_row("niah", "full", 1.0, score=1.0)), json.dumps(_row("niah", "tier:kvp", 0.1, score=1.0))
    path.write_text(whole)                       # a whole record, its newline missing
    assert mend_last_line(path) is None and path.read_text() == whole + "\n"
    path.write_text(whole + "\n" + cut[:40])     # a write cut short
    assert "was cut short" in mend_last_line(path) and read_results(path) == [json.loads(whole)]
    assert mend_last_line(path) is None


def test_a_results_file_of_another_model_is_not_resumed(tmp_path):
    from kvtier.errors import ConfigError
    from kvtier.eval.runner import check_same_model

    import pytest

    rows = [{**_row("niah", "full", 1.0, score=1.0), "model": "SmolLM2-135M-Instruct"}, _row("niah", "full", 1.0)]
    check_same_model(rows, "SmolLM2-135M-Instruct", "r.jsonl")   # rows without a model (older files) are taken
    with pytest.raises(ConfigError, match="r.jsonl holds results of model 'SmolLM2-135M-Instruct'; this run is of "
                                          "'other'"):
        check_same_model(rows, "other", "r.jsonl")


def test_a_value_given_twice_is_run_once():
    from kvtier.eval.runner import _once

    assert _once(["full", "tier:kvp", "full"]) == ("full", "tier:kvp") and _once((0.1, 0.1)) == (0.1,)


def test_a_policy_name_keeps_every_digit_of_its_window():
    from kvtier.eval.policies import Policy

    for text in ("evict:kvp@1000001", "evict:kvp@1000000", "tier:kvp@0.25", "evict:kvp@64"):
        assert Policy.parse(text).name == text and Policy.parse(Policy.parse(text).name) == Policy.parse(text)


def test_report_never_writes_over_its_results_or_its_plot(tmp_path):
    import json

    from click.testing import CliRunner

    from kvtier.cli import main

    results = tmp_path / "r.jsonl"
    results.write_text(json.dumps(_row("niah", "full", 1.0, score=1.0)) + "\n")
    before = results.read_text()
    for out in (results, tmp_path / "plot.png"):   # the markdown over the results; the markdown over its plot
        result = CliRunner().invoke(main, ["report", str(results), "--out", str(out)])
        assert result.exit_code == 2 and "would write over" in result.output, result.output
    assert results.read_text() == before and not (tmp_path / "plot.png").exists()
    result = CliRunner().invoke(main, ["report", str(results), "--out", str(tmp_path / "r.md")])
    assert result.exit_code == 0 and (tmp_path / "r.png").exists()


def test_a_mean_over_other_examples_than_the_full_cache_s_is_marked():
    """full ran two examples, tier:kvp one (the same answer there): the table's means compare unlike sets, so the
    policy's cell is marked and a note says why (it had read 50.0 against 100.0 with no word)."""
    rows = [_row("niah", "full", 1.0, score=1.0), {**_row("niah", "full", 1.0, score=0.0), "seed": 1},
            _row("niah", "tier:kvp", 0.1, score=1.0)]
    text = "\n".join(summary_lines(rows))
    assert "| niah | 50.0 | 100.0* |" in text and "a mean over other examples than the full cache's" in text
    assert "| tier:kvp | 100.0* |" in text
    rows.append({**_row("niah", "tier:kvp", 0.1, score=0.0), "seed": 1})
    text = "\n".join(summary_lines(rows))
    assert "| niah | 50.0 | 50.0 |" in text and "*" not in text


def test_rows_of_another_prompt_are_not_compared_and_a_row_made_again_stands_for_its_run():
    from kvtier.eval.report import latest, matched
    from kvtier.eval.runner import full_recall_mismatches

    full = {**_row("niah", "full", 1.0, score=1.0), "prompt_tokens": 2088, "output": "42"}
    tier = {**_row("niah", "tier-all:kvp", 0.1, score=0.0), "prompt_tokens": 2075, "output": "7"}
    assert matched([full, tier], "niah", "tier-all:kvp", 0.1) == [] and full_recall_mismatches([full, tier]) == []
    again = {**full, "prompt_tokens": 2075, "prompt_sha": "ab", "output": "7"}
    rows = latest([full, tier, again])
    assert len(rows) == 2 and again in rows and full not in rows
    assert matched(rows, "niah", "tier-all:kvp", 0.1) == [(tier, again)] and full_recall_mismatches(rows) == []
    assert not matched([again, {**tier, "prompt_sha": "cd"}], "niah", "tier-all:kvp", 0.1)   # digests decide


def test_budget_columns_keep_every_digit_and_a_full_only_report_shows_its_column(tmp_path):
    from kvtier.eval.report import write_report

    rows = [_row("niah", "full", 1.0, score=1.0), _row("niah", "evict:kvp", 0.12, score=0.5),
            _row("niah", "evict:kvp", 0.125, score=0.75)]
    text = "\n".join(summary_lines(rows, budget=0.125))
    assert "| policy | 12% | 12.5% |" in text and "## Summary at 12.5% of the cache" in text
    write_report([_row("niah", "full", 1.0, score=1.0)], tmp_path / "full.md", "kvtier eval")
    report = (tmp_path / "full.md").read_text()
    assert "| policy | full |" in report and "| full | 100.0 |" in report
