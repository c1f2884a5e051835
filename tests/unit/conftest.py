"""Fixtures of the unit tests that run a model."""

from __future__ import annotations

import pytest
from tiny_models import tiny_llama


@pytest.fixture(scope="module")
def model():
    """The tiny Llama, its attention given back when the module is done."""
    from kvtier.integrations.attention import restore_attention

    m = tiny_llama()
    yield m
    restore_attention(m.config)
