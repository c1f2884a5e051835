"""`kvtier demo`: facts hidden in a long document, answered through the tiered cache next to the full cache."""

from __future__ import annotations

import json
import time

import click
import torch

from .common import check_cache_options, load, parse_budget, set_threads, user_errors
from .format import tier_lines


@click.command()
@click.option("--context", default="3000", show_default=True,
              help="Tokens of filler around each fact (e.g. 3000, 128K, 1M).")
@click.option("--synthetic", is_flag=True, help="Synthetic KV of a real architecture's shape with planted "
              "needles, instead of running a model (for contexts no model here can prefill).")
@click.option("--arch", default="llama-3.1-8b", show_default=True, help="Architecture shape for --synthetic.")
@click.option("--needles", default=2, show_default=True, help="How many facts (each at another depth) to ask about.")
@click.option("--device-budget", default="auto", show_default=True,
              help="Device tokens per KV head: fraction or count (auto: 0.1, or 0.01 with --synthetic).")
@click.option("--host-budget", default="auto", show_default=True,
              help="Host tokens per KV head, the rest on disk; 'none' = no limit (auto: 0.2, or 0.05 with --synthetic).")
@click.option("--recall-pages", default=32, show_default=True, help="Pages recalled per layer and KV head per step.")
@click.option("--scorer", default="auto", show_default=True, help="How entries are ranked (auto: KVP where weights ship for the model, else keynorm).")
@click.option("--disk-dir", default=None, help="Folder for the disk tier (default: a temporary folder).")
@click.option("--model", default=None, help="A Hugging Face id or local path (default: the packaged SmolLM2-135M-Instruct).")
@click.option("--threads", default=1, show_default=True, help="torch CPU threads.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@user_errors
def demo(context: str, synthetic: bool, arch: str, needles: int, device_budget: str, host_budget: str,
         recall_pages: int, scorer: str, disk_dir: str | None, model: str | None, threads: int, as_json: bool) -> None:
    """Answer questions about facts hidden in a long text, with 10% of the KV cache on the device."""
    from transformers import DynamicCache

    from ..integrations.hf import TieredCache, cache_kwargs
    from ..tasks import make_needle_task

    from ..bench.synthetic import ARCHS, parse_tokens

    set_threads(threads)
    say = (lambda *a: None) if as_json else click.echo
    try:
        tokens = parse_tokens(context)
    except ValueError:
        raise click.BadParameter(f"{context!r}; allowed: a token count like 3000, 128K or 1M",
                                 param_hint="--context") from None
    if device_budget == "auto":
        device_budget = "0.01" if synthetic else "0.1"
    if host_budget == "auto":
        host_budget = "0.05" if synthetic else "0.2"
    check_cache_options(parse_budget(device_budget), parse_budget(host_budget), disk_dir)
    if synthetic:
        if arch not in ARCHS:
            raise click.BadParameter(f"{arch!r}; allowed: {', '.join(ARCHS)}", param_hint="--arch")
        from .synthetic_report import run_synthetic

        run_synthetic(arch, tokens, needles, parse_budget(device_budget), parse_budget(host_budget), recall_pages,
                      as_json)
        return
    if tokens > 32768:
        raise click.UsageError(f"prefilling {tokens:,} tokens with a model on this machine is not practical (the "
                               "default model was trained on 8K); add --synthetic to fill the cache with KV of a "
                               "real architecture's shape (--arch) instead")
    say("loading the model ...")
    lm, tok = load(model, quiet=as_json)
    budget, host = parse_budget(device_budget), parse_budget(host_budget)
    report = {"tasks": []}
    for i in range(needles):
        depth = (i + 0.5) / needles * 0.8
        task = make_needle_task(tok, context_tokens=tokens, depth=depth, seed=i)
        row = {"prompt_tokens": task.prompt_tokens, "depth": round(depth, 2), "answer": task.answer}
        for name in ("full", "tiered"):
            cache = (DynamicCache(config=lm.config) if name == "full" else
                     TieredCache(lm.config, device_budget=budget, host_budget=host, disk_dir=disk_dir,
                                 scorer=None if scorer == "auto" else scorer,
                                 recall_pages=recall_pages))
            start = time.perf_counter()
            with torch.no_grad():
                out = lm.generate(task.input_ids, **cache_kwargs(cache), max_new_tokens=24, do_sample=False)
            seconds = time.perf_counter() - start
            text = tok.decode(out[0, task.prompt_tokens:], skip_special_tokens=True).strip()
            row[name] = {"text": text, "correct": task.is_correct(text), "seconds": round(seconds, 2)}
            if name == "tiered":
                row["stats"] = cache.stats()
                cache.close()
        report["tasks"].append(row)
        say(f"\nfact {i + 1}: '{task.key}' -> {task.answer}, at {depth:.0%} of {task.prompt_tokens:,} tokens")
        for name in ("full", "tiered"):
            r = row[name]
            say(f"  {name:<7} {'correct' if r['correct'] else 'WRONG':<8} {r['seconds']:>6.1f} s  {r['text']!r}")
        for line in tier_lines(row["stats"]):
            say(line)
    report["correct"] = {n: sum(t[n]["correct"] for t in report["tasks"]) for n in ("full", "tiered")}
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        c = report["correct"]
        click.echo(f"\ncorrect: full cache {c['full']}/{needles}, tiered cache {c['tiered']}/{needles} "
                   f"(device budget {device_budget}, host {host_budget}, recall {recall_pages} pages, "
                   f"scorer {report['tasks'][-1]['stats']['scorer']})")
