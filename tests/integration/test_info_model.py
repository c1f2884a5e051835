"""`kvtier info --model`: which layers are tiered, which kept, which attention variants apply, or why not."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvtier.cli import main


def _info(*args):
    return CliRunner().invoke(main, ["info", *args])


@pytest.mark.parametrize("arch, tiered, kept, note", [
    ("llama", "32 of 32 layers tiered", None, None),
    ("gemma2", "13 of 26 layers tiered", "13 sliding_attention layers, window 4096", "soft-capping at 50.0"),
    ("gpt_oss", "18 of 36 layers tiered", "18 sliding_attention layers, window 128", "attention sinks"),
    ("mistral", "0 of 32 layers tiered", "32 sliding_attention layers", None),
])
def test_info_model_says_what_is_tiered(arch, tiered, kept, note):
    result = _info("--model", arch)
    assert result.exit_code == 0, result.output
    assert tiered in result.output
    if kept:
        assert kept in result.output
    if note:
        assert note in result.output


def test_info_model_names_why_a_model_is_refused():
    result = _info("--model", "deepseek_v3", "--json")
    assert result.exit_code == 0, result.output
    model = json.loads(result.output)["model"]
    assert model["supported"] is False and "latent attention" in model["reason"]


def test_info_model_default_and_unknown():
    result = _info("--model", "default")
    assert result.exit_code == 0 and "30 of 30 layers tiered" in result.output
    bad = _info("--model", "no-such-architecture")
    assert bad.exit_code == 2 and "no-such-architecture" in bad.output and "allowed:" in bad.output
