"""A multi-turn chat whose KV cache lives on between turns, so each turn prefills only its new tokens."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..errors import ConfigError
from .hf import TieredCache, cache_kwargs
from .model_graph import DecodeGraph


class ChatSession:
    """One conversation: messages, the token ids its cache holds, and the cache itself.

    Parameters
    ----------
    model, tokenizer
        A chat model and its tokenizer (with a chat template).
    cache
        The conversation's cache; by default a new `TieredCache` built with `cache_settings` (settings given with a
        cache are refused: they would not apply).
    system
        An optional system message.
    decode_graph
        Take each reply's tokens through a `DecodeGraph` over the cache (`self.decode_graph`): on CUDA, each steady
        decode step, the model's launches and the cache's, replayed as one CUDA graph. The same replies either way.
    """

    def __init__(self, model: Any, tokenizer: Any, cache: TieredCache | None = None, system: str | None = None,
                 decode_graph: bool = False, **cache_settings: Any) -> None:
        if not isinstance(decode_graph, bool):
            raise ConfigError(f"decode_graph={decode_graph!r}; allowed: True or False")
        if cache is not None and cache_settings:
            raise ConfigError(f"cache settings {', '.join(sorted(cache_settings))} given with a cache, which has its "
                              "own; allowed: a cache, or settings for a new one")
        self.model, self.tokenizer = model, tokenizer
        self.cache = cache if cache is not None else TieredCache(model.config, **cache_settings)
        self.decode_graph = DecodeGraph(model, self.cache) if decode_graph else None
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.ids = torch.empty(1, 0, dtype=torch.long)  # every token of the conversation so far

    def _render(self, messages: list[dict[str, str]], prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)

    def _next_input(self, text: str) -> torch.Tensor:
        """The ids so far, then the new user turn, without re-tokenising what the cache already holds."""
        new_messages = [*self.messages, {"role": "user", "content": text}]
        full = self._render(new_messages, prompt=True)
        if self.ids.shape[1] == 0:
            return self.tokenizer(full, return_tensors="pt", add_special_tokens=False)["input_ids"]
        said = self.tokenizer.decode(self.ids[0], skip_special_tokens=False)
        if not full.startswith(said):
            # a template that rewrites earlier turns (trims them, say): the cache cannot go on from the tokens
            # generated, so the conversation is prefilled again as the template renders it, and says so
            warnings.warn("the chat template renders earlier turns differently from the tokens generated; the "
                          "cache is emptied and the whole conversation prefilled again as the template renders it",
                          RuntimeWarning, stacklevel=3)
            self.cache.reset()
            self.ids = torch.empty(1, 0, dtype=torch.long)
            return self.tokenizer(full, return_tensors="pt", add_special_tokens=False)["input_ids"]
        tail = self.tokenizer(full[len(said):], return_tensors="pt", add_special_tokens=False)["input_ids"]
        return torch.cat([self.ids, tail], dim=1)

    @torch.no_grad()
    def ask(self, text: str, max_new_tokens: int = 128, **generate_kwargs: Any) -> str:
        """Add a user turn, generate the reply (greedy unless told otherwise) and return its text.

        A turn that fails or is interrupted leaves the conversation as it was before it (the messages); if the
        cache had taken part of the turn, it is emptied and the next turn prefills the conversation again.
        """
        ids = self._next_input(text).to(self.model.device)
        generate_kwargs.setdefault("do_sample", False)
        held = self.cache.get_seq_length()
        try:
            if self.decode_graph is not None:
                out = self.decode_graph.generate(ids, max_new_tokens=max_new_tokens, **generate_kwargs)
            else:
                out = self.model.generate(ids, **cache_kwargs(self.cache), max_new_tokens=max_new_tokens,
                                          **generate_kwargs)
        except BaseException:
            if self.cache.get_seq_length() != held or self.cache.broken:
                # the cache took part of the turn that `ids` will never hold: start it afresh, so the next
                # turn prefills the whole conversation again instead of continuing from tokens nobody kept
                self.cache.reset()
                self.ids = torch.empty(1, 0, dtype=torch.long)
            raise
        # the messages keep the reply as generated (a reply cut after "\n\n", or with a space before its end, would
        # otherwise render differently from the tokens the cache holds); the caller gets it stripped
        reply = self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        self.ids = out.cpu()
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
        return reply.strip()

    def park(self, to: str = "host") -> None:
        """Move the conversation's cache off the device until the next turn."""
        self.cache.park(to)
