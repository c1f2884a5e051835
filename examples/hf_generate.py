"""The drop-in cache in ten lines: generate with 10% of the KV cache on the device, the rest in host memory
and on disk, and print where the entries live.

    python examples/hf_generate.py [--short] [--device cpu|cuda|cuda:N]
"""

import argparse

import torch

from kvtier import TieredCache, cache_kwargs, load_default_model

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--short", action="store_true", help="a small run, in seconds")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the model runs (default: cuda when there is one, else cpu)")
args = parser.parse_args()
device = args.device   # the cache's device tier sits where the model runs
model, tokenizer = load_default_model(device=device)
text = "Explain, step by step, how a lighthouse guides ships at night. " * (4 if args.short else 40)
ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)["input_ids"].to(device)
cache = TieredCache(model.config, device_budget=0.1, host_budget=0.3, recall_pages=32)
with torch.no_grad():
    out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=16 if args.short else 64)
print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
print({tier: cache.stats()[tier] for tier in ("device", "host", "disk")})
cache.close()
