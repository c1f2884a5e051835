"""`kvtier demo`: facts hidden in a long document, answered through the tiered cache next to the full cache."""

from __future__ import annotations

import json
import time

import click
import torch

from .common import (DEVICE_HELP, MAX_MODEL_CONTEXT, THREADS, check_cache_options, check_chat_template, check_model,
                     check_scorer, load, parse_budget, parse_context, resolve_device, set_threads, user_errors)
from .format import human_bytes, tier_lines

MIN_CONTEXT = 256            # a model demo's prompt: the fact, a question and some filler around them
SYNTHETIC_MIN_CONTEXT = 256  # --synthetic: needles at random spots past the first and before the last 32 tokens
SYNTHETIC_MAX_CONTEXT = 2**30


def check_synthetic_disk(arch: str, tokens: int, disk_dir: str | None) -> None:
    """A synthetic context larger than the disk tier's free space is a mistake: say so now, not when it fills."""
    import shutil
    import tempfile
    from pathlib import Path

    from ..bench.synthetic import ARCHS

    _, _, kv_heads, dim = ARCHS[arch]
    need = tokens * kv_heads * dim * 2 * 2  # keys and values, bfloat16, all of it on disk at worst
    folder = Path(disk_dir or tempfile.gettempdir()).expanduser().absolute()
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if need > free:
        raise click.BadParameter(
            f"{tokens:,} tokens of {arch} need about {human_bytes(need)} of disk, and {folder} has "
            f"{human_bytes(free)} free; allowed: a shorter --context or a --disk-dir with more room",
            param_hint="'--context'")


@click.command()
@click.option("--context", default="3000", show_default=True,
              help="Tokens of filler around each fact (e.g. 3000, 128K, 1M).")
@click.option("--synthetic", is_flag=True, help="Synthetic KV of a real architecture's shape with planted "
              "needles, instead of running a model (for contexts no model here can prefill).")
@click.option("--arch", default="llama-3.1-8b", show_default=True, help="Architecture shape for --synthetic.")
@click.option("--needles", default=2, show_default=True, type=click.IntRange(min=1),
              help="How many facts (each at another depth) to ask about.")
@click.option("--device-budget", default="auto", show_default=True,
              help="Device tokens per KV head: fraction or count (auto: 0.1, or 0.01 with --synthetic).")
@click.option("--host-budget", default="auto", show_default=True,
              help="Host tokens per KV head, the rest on disk; 'none' = no limit (auto: 0.2, or 0.05 with --synthetic).")
@click.option("--recall-pages", default=32, show_default=True, type=click.IntRange(min=0),
              help="Pages recalled per layer and KV head per step (0: no recall; --synthetic needs 1 or more).")
@click.option("--scorer", default="auto", show_default=True,
              help="How entries are ranked (auto: KVP where weights ship for the model, else keynorm; with --synthetic "
                   "an attention-free scorer: keynorm, recency, keydiff or random).")
@click.option("--disk-dir", default=None, help="Folder for the disk tier (default: a temporary folder).")
@click.option("--model", default=None, help="A Hugging Face id or local path (default: the packaged SmolLM2-135M-Instruct).")
@click.option("--device", default="auto", show_default=True, help=DEVICE_HELP)
@click.option("--threads", default=1, show_default=True, type=THREADS, help="torch CPU threads.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@user_errors
def demo(context: str, synthetic: bool, arch: str, needles: int, device_budget: str, host_budget: str,
         recall_pages: int, scorer: str, disk_dir: str | None, model: str | None, device: str, threads: int,
         as_json: bool) -> None:
    """Answer questions about facts hidden in a long text, with 10% of the KV cache on the device."""
    say = (lambda *a: None) if as_json else click.echo
    given = click.get_current_context().get_parameter_source
    if synthetic and model is not None:
        raise click.BadParameter(f"{model!r} with --synthetic, where no model runs (its KV is drawn in the shape of "
                                 "--arch); allowed: --model without --synthetic", param_hint="'--model'")
    if not synthetic and given("arch") is not click.core.ParameterSource.DEFAULT:
        raise click.BadParameter(f"{arch!r} without --synthetic (the model's own shape is used); allowed: --arch "
                                 "with --synthetic", param_hint="'--arch'")
    if synthetic:
        tokens = parse_context(context, "--context", SYNTHETIC_MIN_CONTEXT, SYNTHETIC_MAX_CONTEXT, allowed=(
            f"a token count like 3000, 128K or 1M, from {SYNTHETIC_MIN_CONTEXT} to {SYNTHETIC_MAX_CONTEXT // 2**20}M"))
        if needles > tokens // 64:
            raise click.BadParameter(f"{needles} needles in {tokens:,} tokens; allowed: at most one needle per 64 "
                                     f"tokens ({tokens // 64} here)", param_hint="'--needles'")
        if recall_pages < 1:
            raise click.BadParameter(f"{recall_pages} turns recall off, and --synthetic checks what recall finds; "
                                     "allowed: 1 or more", param_hint="'--recall-pages'")
    else:
        tokens = parse_context(context, "--context", MIN_CONTEXT, MAX_MODEL_CONTEXT, allowed=(
            f"a token count from {MIN_CONTEXT} to {MAX_MODEL_CONTEXT // 1024}K (e.g. 3000 or 8K); longer contexts "
            "need --synthetic, which fills the cache with KV of a real architecture's shape (--arch) instead"))
    if device_budget == "auto":
        device_budget = "0.01" if synthetic else "0.1"
    if host_budget == "auto":
        host_budget = "0.05" if synthetic else "0.2"
    budget, host = parse_budget(device_budget, "--device-budget"), parse_budget(host_budget, "--host-budget")
    if synthetic and host is None:
        raise click.BadParameter(f"{host_budget!r}: --synthetic fills the disk tier, so the host needs a limit; "
                                 "allowed: a fraction like 0.05 or a token count like 4096",
                                 param_hint="'--host-budget'")
    disk_dir = check_cache_options(budget, host, disk_dir, recall_pages)
    check_scorer(scorer)
    where = resolve_device(device)
    if synthetic:
        from ..bench.synthetic import ARCHS
        from ..placement import Budget
        from ..scoring import BASELINES_ATTENTION_FREE

        if arch not in ARCHS:
            raise click.BadParameter(f"{arch!r} is not a known architecture; allowed: {', '.join(ARCHS)}",
                                     param_hint="'--arch'")
        if scorer not in ("auto", *BASELINES_ATTENTION_FREE):
            raise click.BadParameter(f"{scorer!r} with --synthetic, where no model runs (no queries to attend with, "
                                     f"no model's KVP weights); allowed: auto (keynorm), "
                                     f"{', '.join(BASELINES_ATTENTION_FREE)}", param_hint="'--scorer'")
        if Budget(budget, "--device-budget").tokens(tokens) >= tokens:
            raise click.BadParameter(f"{device_budget!r} holds all {tokens:,} tokens on the device: nothing is "
                                     "demoted, so recall has nothing to find; allowed: a budget below the context",
                                     param_hint="'--device-budget'")
        check_synthetic_disk(arch, tokens, disk_dir)
        set_threads(threads)
        from .synthetic_report import run_synthetic

        run_synthetic(arch, tokens, needles, budget, host, recall_pages, as_json, disk_dir=disk_dir, device=str(where),
                      scorer="keynorm" if scorer == "auto" else scorer)
        return
    check_model(model)
    set_threads(threads)
    say("loading the model ...")
    lm, tok = load(model, quiet=as_json, device=where)
    check_chat_template(tok, model)

    from transformers import DynamicCache

    from ..integrations.hf import TieredCache, cache_kwargs
    from ..tasks import make_needle_task

    report = {"device": str(where), "settings": {"device_budget": budget, "host_budget": host,
                                                 "recall_pages": recall_pages}, "tasks": []}
    for i in range(needles):
        depth = (i + 0.5) / needles * 0.8
        task = make_needle_task(tok, context_tokens=tokens, depth=depth, seed=i)
        row = {"prompt_tokens": task.prompt_tokens, "depth": round(depth, 2), "key": task.key, "answer": task.answer}
        for name in ("full", "tiered"):
            cache = (DynamicCache(config=lm.config) if name == "full" else
                     TieredCache(lm.config, device_budget=budget, host_budget=host, disk_dir=disk_dir,
                                 scorer=None if scorer == "auto" else scorer,
                                 recall_pages=recall_pages))
            start = time.perf_counter()
            with torch.no_grad():
                out = lm.generate(task.input_ids.to(where), **cache_kwargs(cache), max_new_tokens=24,
                                  do_sample=False)
            seconds = time.perf_counter() - start
            text = tok.decode(out[0, task.prompt_tokens:], skip_special_tokens=True).strip()
            row[name] = {"text": text, "correct": task.is_correct(text), "seconds": round(seconds, 2)}
            if name == "tiered":
                row["stats"] = cache.stats()
                report["settings"].setdefault("scorer", row["stats"]["scorer"])   # "auto" resolved
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
                   f"(on {where}: device budget {device_budget}, host {host_budget}, recall {recall_pages} pages, "
                   f"scorer {report['tasks'][-1]['stats']['scorer']})")
