"""Plug in your own scorer: a `name` and ``score(keys, values, positions, layer_idx)`` returning one float
per entry and KV head (a `kvtier.scoring.Scorer`). This one blends key norm with a preference for recent tokens.

A scorer that ranks from attention weights sets ``needs_query = True`` and also takes the keywords ``query``,
``context_keys`` and ``scaling`` (a `QueryScorer`): the cache then scores its entries after attention. See
docs/scorer.md, "Writing a scorer".

    python examples/custom_scorer.py [--short] [--device cpu|cuda|cuda:N]
"""

import argparse

import torch

from kvtier import TieredCache, cache_kwargs, load_default_model


class RecentSmallKeys:
    """Small keys and recent positions rank high; `weight` trades one for the other."""

    name = "recent-small-keys"

    def __init__(self, weight: float = 0.5) -> None:
        self.weight = weight

    def score(self, keys, values, positions, layer_idx):
        norm = torch.linalg.vector_norm(keys.float(), dim=-1)                  # [batch, kv_heads, tokens]
        recency = torch.log1p(positions.float()).to(keys.device)                # [tokens]
        return -norm + self.weight * recency


parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--short", action="store_true", help="a small run, in seconds")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the model runs (default: cuda when there is one, else cpu)")
args = parser.parse_args()
device = args.device
model, tokenizer = load_default_model(device=device)
question = "Name three things a lighthouse keeper does every night. "
ids = tokenizer.apply_chat_template([{"role": "user", "content": question * (3 if args.short else 30)}],
                                    add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
ids = ids.to(device)
cache = TieredCache(model.config, device_budget=0.2, scorer=RecentSmallKeys(), recall_pages=16)
with torch.no_grad():
    out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=12 if args.short else 48)
print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
print("scorer:", cache.stats()["scorer"], "| device tokens:", cache.stats()["device"]["tokens"])
cache.close()
