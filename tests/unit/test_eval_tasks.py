"""Evaluation tasks are deterministic, sized as asked, and hold their answers; policies parse strictly."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kvtier import ConfigError
from kvtier.eval.policies import Policy
from kvtier.eval.tasks import TASKS, make_example
from kvtier.models import default_model_path


@pytest.fixture(scope="module")
def tokenizer():
    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("task", TASKS)
def test_task_is_deterministic_and_sized(tokenizer, task):
    a, b = make_example(tokenizer, task, 2048, 3), make_example(tokenizer, task, 2048, 3)
    assert (a.input_ids == b.input_ids).all() and a.answers == b.answers
    assert 0.6 * 2048 <= a.input_ids.shape[1] <= 1.4 * 2048
    if task == "perplexity":
        assert a.continuation.shape[1] == 256
        return
    prompt = tokenizer.decode(a.input_ids[0])
    assert a.answers and all(ans in prompt for ans in a.answers)
    assert a.score(" ".join(a.answers)) == 1.0 and a.score("nothing") == 0.0
    assert make_example(tokenizer, task, 2048, 4).answers != a.answers or task in ("frequent_words",)


def test_policy_parsing():
    assert Policy.parse("full").name == "full"
    assert Policy.parse("tier-all:kvp").cache_settings(0.1)["recall_pages"] > 10_000
    assert Policy.parse("evict:tova").cache_settings(0.25) == {"device_budget": 0.25, "mode": "evict", "scorer": "tova"}
    for bad in ("tier", "evict:", "drop:kvp", "full:kvp"):
        with pytest.raises(ConfigError, match="allowed: full"):
            Policy.parse(bad)
