"""`kvtier bench`: measured side by side, in one run, on one machine."""

from __future__ import annotations

import json
import platform

import click
import torch

from .common import (THREADS, check_cache_options, check_device, check_model, check_scorer, load,
                     parse_budget, set_threads, user_errors)


@click.group()
def bench() -> None:
    """Benchmarks of kvtier against its baselines."""


@bench.command("decode")
@click.option("--context", default=4096, show_default=True, type=click.IntRange(1, 2**24),
              help="Prompt tokens before decoding.")
@click.option("--new-tokens", default=64, show_default=True, type=click.IntRange(min=1),
              help="Decode steps timed per round.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1),
              help="Interleaved rounds; the median is reported.")
@click.option("--device-budget", default="0.25", show_default=True, help="Device tokens per KV head.")
@click.option("--host-budget", default="none", show_default=True, help="Host tokens per KV head ('none' = no limit).")
@click.option("--recall-pages", default=64, show_default=True, type=click.IntRange(min=0),
              help="Pages recalled per layer and KV head per step.")
@click.option("--scorer", default="auto", show_default=True, help="auto: KVP where weights ship for the model, else keynorm.")
@click.option("--model", default=None, help="A Hugging Face id or local path (default: the packaged model).")
@click.option("--device", default="cpu", show_default=True, help="Where the model runs (cpu, cuda).")
@click.option("--threads", default=1, show_default=True, type=THREADS, help="torch CPU threads.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@user_errors
def decode(context: int, new_tokens: int, rounds: int, device_budget: str, host_budget: str, recall_pages: int,
           scorer: str, model: str | None, device: str, threads: int, as_json: bool) -> None:
    """Decode tokens/s of TieredCache vs DynamicCache after the same long prompt."""
    budget, host = parse_budget(device_budget, "--device-budget"), parse_budget(host_budget, "--host-budget")
    check_cache_options(budget, host, None, recall_pages)
    check_scorer(scorer)
    check_device(device)
    check_model(model)
    set_threads(threads)
    lm, tok = load(model, quiet=as_json)

    from transformers import DynamicCache

    from ..bench.decode import compare_decode
    from ..integrations.hf import TieredCache
    from ..tasks.needle import NOISE

    lm.to(device)
    unit = tok(NOISE, add_special_tokens=False, return_tensors="pt")["input_ids"]
    ids = unit.repeat(1, context // unit.shape[1] + 1)[:, :context].to(device)
    caches = {
        "DynamicCache": lambda: DynamicCache(config=lm.config),
        "TieredCache": lambda: TieredCache(lm.config, device_budget=budget, host_budget=host,
                                           scorer=None if scorer == "auto" else scorer, recall_pages=recall_pages),
    }
    echo = (lambda s: None) if as_json else click.echo
    results = compare_decode(lm, ids, caches, new_tokens, rounds, progress=echo)
    base = results[0].tokens_per_second
    out = {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "threads": torch.get_num_threads(), "device": device},
        "context": context, "new_tokens": new_tokens, "rounds": rounds,
        "settings": {"device_budget": budget, "host_budget": host, "recall_pages": recall_pages, "scorer": scorer},
        "results": [{"cache": r.name, "tokens_per_second": round(r.tokens_per_second, 2),
                     "ratio": round(r.tokens_per_second / base, 3),
                     "seconds": [round(s, 3) for s in r.seconds]} for r in results],
    }
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(f"\ncontext {context:,} tokens, {new_tokens} decode steps x {rounds} rounds, "
               f"{torch.get_num_threads()} thread(s), {device}")
    for r in out["results"]:
        click.echo(f"  {r['cache']:<14}{r['tokens_per_second']:>8.1f} tokens/s   x{r['ratio']:.2f}")
