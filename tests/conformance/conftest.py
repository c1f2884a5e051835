"""Architecture conformance: tiny random-weight models of many architectures, TieredCache vs DynamicCache."""

from __future__ import annotations

import pytest
import torch

import archs

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _own_attention_back():
    """The models are shared between tests: give each its own attention back after every test (a TieredCache
    routes the model's attention through kvtier, and a failing test may leave it so)."""
    yield
    from kvtier.integrations.attention import restore_attention

    for model in archs.built_models():
        restore_attention(model.config)
