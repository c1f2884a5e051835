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
    assert "| perplexity | 9.00 | 9.25 | 12.00 | 11.00 (keynorm) | 13.00 (tova) |" in text
    assert "largest departure from the full cache over the generation tasks is +0.0 points (niah)" in text
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
