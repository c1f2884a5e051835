"""Prompts as the model sees them: one user message through the tokenizer's chat template."""

from __future__ import annotations

from typing import Any

import torch


def chat_ids(tokenizer: Any, content: str) -> torch.Tensor:
    """``[1, tokens]`` ids of `content` as a user turn, ending where the assistant's answer begins."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    return ids["input_ids"]
