"""`kvtier bench`: measured side by side, in one run, on one machine."""

from __future__ import annotations

import itertools
import json
import os
import platform
import statistics
from typing import Callable

import click
import torch

from .common import (THREADS, bad_option, check_cache_options, check_device, check_model, check_scorer,
                     command_started, load, parse_budget, parse_demote_pages, parse_plan_recall, parse_promote,
                     parse_read_ahead, parse_retain_pages, promote_name, read_ahead_name, set_threads,
                     tiered_row_name, user_errors)

BENCH_MAX_CONTEXT = 2**24   # the most tokens any bench prefills or fills (16M: beyond what a GPU of today holds)


@click.group()
def bench() -> None:
    """Benchmarks of kvtier against its baselines."""


def _checked_and_loaded(scorer: str, device: str, model: str | None, threads: int, quiet: bool) -> tuple:
    """The checks every model-driven bench makes before loading, then the model on `device` and its tokenizer."""
    check_scorer(scorer)
    check_device(device)
    check_model(model)
    set_threads(threads)
    lm, tok = load(model, quiet=quiet)
    lm.to(device)
    return lm, tok


def _filler_ids(tok, context: int, device: str) -> torch.Tensor:
    """`context` tokens of filler text ``[1, context]`` on `device`: the prompt of the benches that time a model
    over a long context with nothing to find in it (`decode`, `resume`)."""
    from ..tasks.needle import NOISE

    unit = tok(NOISE, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return unit.repeat(1, context // unit.shape[1] + 1)[:, :context].to(device)


def _machine(device: str) -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "device": device}


# the cache rows of a bench that compares demote_pages settings
_DEMOTE_PAGES = click.option("--demote-pages", default="auto", show_default=True,
                             help="Comma list of demote_pages settings, one TieredCache row each (auto: the "
                                  "cache's default).")


def _model_run_options(f: Callable) -> Callable:
    """The options of the benches that run a model over a filler prompt (`decode`, `resume`): the pages recalled,
    the scorer, the model, where it runs and on how many threads."""
    for option in reversed([
        click.option("--recall-pages", default=64, show_default=True, type=click.IntRange(min=0),
                     help="Pages recalled per layer and KV head per step."),
        click.option("--scorer", default="auto", show_default=True,
                     help="auto: KVP where weights ship for the model, else keynorm."),
        click.option("--model", default=None, help="A Hugging Face id or local path (default: the packaged model)."),
        click.option("--device", default="cpu", show_default=True, help="Where the model runs (cpu, cuda)."),
        click.option("--threads", default=1, show_default=True, type=THREADS, help="torch CPU threads.")]):
        f = option(f)
    return f


def _needle_bench_options(*own: Callable) -> Callable[[Callable], Callable]:
    """The options of the benches that decode a needle prompt (`prefetch`, `launches`), with the bench's `own`
    options after the prompt's length."""
    shared_tail = [
        click.option("--device-budget", default="0.1", show_default=True, help="Device tokens per KV head."),
        click.option("--recall-pages", default=64, show_default=True, type=click.IntRange(min=1),
                     help="Pages recalled per layer and KV head per step."),
        click.option("--scorer", default="auto", show_default=True,
                     help="auto: KVP where weights ship for the model, else keynorm."),
        click.option("--model", default=None, help="A Hugging Face id or local path (default: the packaged model)."),
        click.option("--device", default="cpu", show_default=True, help="Where the model runs (cpu, cuda)."),
        click.option("--threads", default=1, show_default=True, type=THREADS, help="torch CPU threads."),
        click.option("--seed", default=0, show_default=True, type=int, help="Seed of the needle task."),
        click.option("--json", "as_json", is_flag=True, help="Print JSON."),
    ]
    context = click.option("--context", default="8K", show_default=True,
                           help="Tokens of the prompt (a needle task: a long text, then a question about it).")

    def apply(f):
        for option in reversed([context, *own, *shared_tail]):
            f = option(f)
        return f
    return apply


def _needle_budget(context: str, device_budget: str, recall_pages: int,
                   host_budget: float | int | None = None) -> tuple[int, float | int]:
    """The prompt's tokens and the device budget, checked with the host budget (a needle bench needs a device
    tier)."""
    from .common import parse_context

    tokens = parse_context(context, "--context", 256, BENCH_MAX_CONTEXT)
    budget = parse_budget(device_budget, "--device-budget")
    if budget is None:
        raise bad_option("--device-budget", device_budget, "a fraction like 0.1 or a token count like 4096",
                         "leaves no device tier")
    check_cache_options(budget, host_budget, None, recall_pages)
    return tokens, budget


@bench.command("decode")
@click.option("--context", default=4096, show_default=True, type=click.IntRange(1, BENCH_MAX_CONTEXT),
              help="Prompt tokens before decoding.")
@click.option("--new-tokens", default=64, show_default=True, type=click.IntRange(min=1),
              help="Decode steps timed per round.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1),
              help="Interleaved rounds; the median is reported.")
@click.option("--device-budget", default="0.25", show_default=True, help="Device tokens per KV head.")
@click.option("--host-budget", default="none", show_default=True, help="Host tokens per KV head ('none' = no limit).")
@_model_run_options
@_DEMOTE_PAGES
@click.option("--cold-disk", is_flag=True,
              help="Before each timed step, drop the disk tier's file from the page cache (Linux), so that disk "
                   "pages are read from the device, not from memory; outside the timing.")
@click.option("--read-ahead", default="auto", show_default=True,
              help="Comma list of read_ahead settings for disk pages, one TieredCache row each: auto (judged as it "
                   "goes), on, off.")
@click.option("--promote", default="off", show_default=True,
              help="Comma list of promote settings, one TieredCache row each: on (the host tier keeps the disk pages "
                   "recall keeps bringing up), off.")
@click.option("--retain-pages", default="auto", show_default=True,
              help="Comma list of retain_pages settings, one TieredCache row each: pages per layer and KV head the "
                   "recall buffer keeps after a step stops choosing them (recall planned on the host, the CPU; "
                   "auto: the cache's default).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@user_errors
def decode(context: int, new_tokens: int, rounds: int, device_budget: str, host_budget: str, recall_pages: int,
           scorer: str, model: str | None, device: str, threads: int, demote_pages: str, cold_disk: bool,
           read_ahead: str, promote: str, retain_pages: str, as_json: bool) -> None:
    """Decode tokens/s of TieredCache vs DynamicCache after the same long prompt."""
    budget, host = parse_budget(device_budget, "--device-budget"), parse_budget(host_budget, "--host-budget")
    check_cache_options(budget, host, None, recall_pages)
    demotes = parse_demote_pages(demote_pages)
    aheads = parse_read_ahead(read_ahead)
    promotes = parse_promote(promote)
    retains = parse_retain_pages(retain_pages)
    if cold_disk and host is None:
        raise bad_option("--host-budget", host_budget, "a budget that sends pages to disk", "with --cold-disk")
    if aheads != [None] and host is None:
        raise bad_option("--host-budget", host_budget, "a budget that sends pages to disk",
                         f"with --read-ahead {read_ahead}")
    if promotes != [False] and host is None:
        raise bad_option("--host-budget", host_budget, "a budget that sends pages to disk",
                         f"with --promote {promote}")
    if cold_disk and not hasattr(os, "posix_fadvise"):
        raise bad_option("--cold-disk", "set", "a system with posix_fadvise (Linux)", "cannot drop the page cache here")
    lm, tok = _checked_and_loaded(scorer, device, model, threads, as_json)

    from transformers import DynamicCache

    from ..bench.decode import compare_decode, drop_cached_disk
    from ..integrations.hf import TieredCache

    ids = _filler_ids(tok, context, device)
    caches = {"DynamicCache": lambda: DynamicCache(config=lm.config)}
    settings = {}
    for d, a, p, r in itertools.product(demotes, aheads, promotes, retains):
        name = tiered_row_name(d, len(demotes), a, len(aheads), p, len(promotes), retain=r, retain_rows=len(retains))
        settings[name] = {"demote_pages": d, "read_ahead": read_ahead_name(a), "promote": promote_name(p),
                          "retain_pages": "auto" if r is None else r}
        caches[name] = (lambda d=d, a=a, p=p, r=r: TieredCache(
            lm.config, device_budget=budget, host_budget=host, demote_pages=d, read_ahead=a, promote=p,
            **({} if r is None else {"retain_pages": r}), scorer=None if scorer == "auto" else scorer,
            recall_pages=recall_pages))
    echo = (lambda s: None) if as_json else click.echo
    results = compare_decode(lm, ids, caches, new_tokens, rounds, progress=echo,
                             before_step=drop_cached_disk if cold_disk else None)
    base = results[0].tokens_per_second
    out = {
        "machine": _machine(device),
        "context": context, "new_tokens": new_tokens, "rounds": rounds,
        "settings": {"device_budget": budget, "host_budget": host, "recall_pages": recall_pages, "scorer": scorer,
                     "cold_disk": cold_disk, "read_ahead": [read_ahead_name(a) for a in aheads],
                     "promote": [promote_name(p) for p in promotes],
                     "retain_pages": ["auto" if r is None else r for r in retains]},
        "results": [{"cache": r.name, "tokens_per_second": round(r.tokens_per_second, 2),
                     "ratio": round(r.tokens_per_second / base, 3),
                     "seconds": [round(s, 3) for s in r.seconds],
                     **({"settings": settings[r.name], "demotions": r.stats["demotions"],
                         "read_ahead": r.stats["read_ahead"], "promotion": r.stats["promotion"],
                         "pages_recalled_from": r.stats["pages_recalled_from"],
                         "pages_reused": r.stats["pages_reused"]} if r.stats else {})}
                    for r in results],
    }
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(f"\ncontext {context:,} tokens, {new_tokens} decode steps x {rounds} rounds, "
               f"{torch.get_num_threads()} thread(s), {device}")
    width = max(18, *(len(r["cache"]) + 2 for r in out["results"]))
    for r in out["results"]:
        click.echo(f"  {r['cache']:<{width}}{r['tokens_per_second']:>8.1f} tokens/s   x{r['ratio']:.2f}")


@bench.command("resume")
@click.option("--context", default=8192, show_default=True, type=click.IntRange(16, BENCH_MAX_CONTEXT),
              help="Prompt tokens of the conversation before it is parked.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1),
              help="Rounds, the rows taking turns in each; the median is reported.")
@click.option("--think-ms", default="0,1000", show_default=True,
              help="Comma list of milliseconds between the start of the reads ahead (prefetch) and the step, one "
                   "row each: the time the application has before the conversation's next turn.")
@click.option("--device-budget", default="0.1", show_default=True, help="Device tokens per KV head.")
@click.option("--host-budget", default="0.2", show_default=True,
              help="Host tokens per KV head while the conversation is live ('none' = no limit).")
@_model_run_options
@click.option("--cold-disk/--warm-disk", default=True, show_default=True,
              help="Drop the cache's files from the page cache (Linux) before each row's clock starts, so that the "
                   "restore reads the disk itself, as for a conversation parked long ago.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@user_errors
def resume(context: int, rounds: int, think_ms: str, device_budget: str, host_budget: str, recall_pages: int,
           scorer: str, model: str | None, device: str, threads: int, cold_disk: bool, as_json: bool) -> None:
    """Time to the first token of a conversation parked on disk: restored on demand, or read back ahead while
    the application waits for its next turn (`TieredCache.prefetch_parked`); also parked in host memory."""
    from .common import split_list

    budget, host = parse_budget(device_budget, "--device-budget"), parse_budget(host_budget, "--host-budget")
    check_cache_options(budget, host, None, recall_pages)
    thinks = []
    for item in split_list(think_ms, "--think-ms"):
        try:
            value = float(item)
        except ValueError:
            value = -1.0
        if not 0 <= value <= 600_000:
            raise bad_option("--think-ms", think_ms, "a comma list of milliseconds from 0 to 600000, like 0,1000",
                             f"has {item!r}")
        thinks.append(value / 1000)
    if cold_disk and not hasattr(os, "posix_fadvise"):
        raise bad_option("--cold-disk", "set", "--warm-disk on a system without posix_fadvise (Linux)",
                         "cannot drop the page cache here")
    lm, tok = _checked_and_loaded(scorer, device, model, threads, as_json)

    from ..bench.resume import compare_resume
    from ..integrations.hf import TieredCache

    ids = _filler_ids(tok, context, device)
    echo = (lambda s: None) if as_json else click.echo
    rows, identical, parked = compare_resume(
        lm, ids, lambda: TieredCache(lm.config, device_budget=budget, host_budget=host, recall_pages=recall_pages,
                                     scorer=None if scorer == "auto" else scorer),
        thinks, rounds, cold_disk, progress=echo)
    base = next(r for r in rows if r.name == "restored on demand").median_seconds
    out = {
        "machine": _machine(device),
        "context": context, "rounds": rounds, "identical_logits": identical,
        "settings": {"device_budget": budget, "host_budget": host, "recall_pages": recall_pages, "scorer": scorer,
                     "cold_disk": cold_disk},
        "parked_disk_bytes": parked["disk"]["disk"]["bytes"],
        # host memory held (`stats()["host"]["reserved_bytes"]`): by the cache that ran the prompt, by a copy of it
        # (its host pages packed into new slabs) live and parked on the host
        "prefilled_host_reserved_bytes": parked["prefilled"]["host"]["reserved_bytes"],
        "live_host_reserved_bytes": parked["copy"]["host"]["reserved_bytes"],
        "parked_host_reserved_bytes": parked["host"]["host"]["reserved_bytes"],
        "rows": [{"row": r.name, "think_ms": None if r.think_seconds is None else r.think_seconds * 1000,
                  "first_token_ms": round(r.median_seconds * 1000, 2),
                  "restore_ms": round(statistics.median(r.restore_seconds) * 1000, 2),
                  "rounds_ms": [round(t * 1000, 2) for t in r.first_token_seconds],
                  "on_demand_over_this": round(base / r.median_seconds, 3),
                  "restore_waited_ms": round(statistics.median(r.waited_seconds) * 1000, 2),
                  "layers_read_ahead": r.layers_read_ahead[-1]} for r in rows],
    }
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(f"\ncontext {context:,} tokens parked on disk ({out['parked_disk_bytes'] / 2**20:,.1f} MiB), "
               f"{'cold' if cold_disk else 'warm'} disk, {rounds} rounds, {device}; host memory held "
               f"{out['prefilled_host_reserved_bytes'] / 2**20:,.1f} MiB by the prefilled cache, by a copy "
               f"{out['live_host_reserved_bytes'] / 2**20:,.1f} MiB live and "
               f"{out['parked_host_reserved_bytes'] / 2**20:,.1f} MiB parked on the host")
    for r in out["rows"]:
        click.echo(f"  {r['row']:<30}{r['first_token_ms']:>9.1f} ms to the first token (restore "
                   f"{r['restore_ms']:6.1f} ms)   on demand / this x{r['on_demand_over_this']:.2f}")
    click.echo(f"  same logits in every row: {'yes' if identical else 'NO'}")


@bench.command("prefetch")
@_needle_bench_options(
    click.option("--new-tokens", default=32, show_default=True, type=click.IntRange(min=1),
                 help="Greedy decode steps after the prompt."),
    click.option("--prefetch-pages", "spares", default="0,16,32,64", show_default=True,
                 help="Comma list of prefetch_pages settings compared (0: no prefetch, the buffer keeps only the "
                      "last choice)."))
@user_errors
def prefetch(context: str, new_tokens: int, device_budget: str, recall_pages: int, spares: str, scorer: str,
             model: str | None, device: str, threads: int, seed: int, as_json: bool) -> None:
    """How often each decode step's chosen pages are already on the device, with and without prefetching the
    pages ranked after the last choice (recall planned on the device, as on a GPU; same prompt, same run)."""
    from .common import bad_option, split_list

    tokens, budget = _needle_budget(context, device_budget, recall_pages)
    settings = []
    for item in split_list(spares, "--prefetch-pages"):
        if not item.isdigit():
            raise bad_option("--prefetch-pages", spares, "a comma list of whole numbers >= 0, like 0,16,32",
                             f"has {item!r}")
        settings.append(int(item))
    lm, tok = _checked_and_loaded(scorer, device, model, threads, as_json)

    from ..bench.prefetch import prefetch_study
    from ..tasks.needle import make_needle_task

    task = make_needle_task(tok, tokens, depth=0.3, seed=seed)
    echo = (lambda s: None) if as_json else click.echo
    rows = prefetch_study(lm, task.input_ids.to(device), settings, new_tokens, budget, recall_pages,
                          None if scorer == "auto" else scorer, progress=echo)
    heads = lm.config.num_key_value_heads
    out = {
        "machine": _machine(device),
        "prompt_tokens": task.prompt_tokens, "new_tokens": new_tokens,
        "settings": {"device_budget": budget, "recall_pages": recall_pages, "scorer": scorer, "seed": seed},
        "same_tokens": all(r.tokens == rows[0].tokens for r in rows),
        "text": tok.decode(rows[0].tokens),
        "rows": [r.as_dict(heads) for r in rows],
    }
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(f"\n{task.prompt_tokens:,}-token prompt, {new_tokens} decode steps, device budget {budget}, "
               f"{recall_pages} pages recalled per layer and KV head, {device}")
    click.echo(f"  {'prefetch':>8}  {'on device':>9}  {'on demand':>9}  {'prefetched':>10}  {'prefetch hits':>13}")
    for r in out["rows"]:
        hit = "-" if r["prefetch_hit_rate"] is None else f"{r['prefetch_hit_rate']:.1%}"
        held = "-" if r["on_device_when_chosen"] is None else f"{r['on_device_when_chosen']:.1%}"   # none chosen
        click.echo(f"  {r['prefetch_pages']:>8}  {held:>9}  "
                   f"{r['on_demand_pages_per_step']:>9.2f}  {r['prefetched_pages_per_step']:>10.2f}  {hit:>13}")
    click.echo("  (on device: chosen pages already there when chosen; pages per layer, KV head and step)")
    click.echo(f"  same tokens in every setting: {'yes' if out['same_tokens'] else 'NO'}")


@bench.command("launches")
@_needle_bench_options(
    click.option("--steps", default=72, show_default=True, type=click.IntRange(min=1),
                 help="Decode steps counted (after two that are not); at a 10% device budget and the default page "
                      "size and demote_pages, 72 hold about one demotion per layer."),
    _DEMOTE_PAGES,
    click.option("--prefetch", "prefetch_at", default="in-step", show_default=True,
                 type=click.Choice(["in-step", "side-stream"]),
                 help="Where a step's prefetch runs: at the end of its own device work (as a GPU with CUDA graphs "
                      "runs it, the default there) or as work of its own on the side stream (as eager steps do)."),
    click.option("--host-budget", default=None,
                 help="Host tokens per KV head (fraction or count); past it pages go to disk (default: no limit)."),
    click.option("--plan-recall", default="device", show_default=True,
                 help="Comma list of where recall is planned, one TieredCache row each: device (as on a GPU, "
                      "layers with disk pages included) or host (the CPU's path)."))
@user_errors
def launches(context: str, steps: int, demote_pages: str, prefetch_at: str, host_budget: str | None,
             plan_recall: str, device_budget: str, recall_pages: int, scorer: str, model: str | None, device: str,
             threads: int, seed: int, as_json: bool) -> None:
    """Kernel launches per layer of a decode step (tensor operations; on a GPU each costs the host a few
    microseconds), kvtier (recall planned, pages chosen and entries scored as on a GPU) against DynamicCache,
    by part; and the host time per layer-step in the cache's own code, the kernels' twins left out. On CUDA the
    steps run eagerly (no CUDA graphs), so that every launch is counted."""
    host = parse_budget(host_budget, "--host-budget")
    tokens, budget = _needle_budget(context, device_budget, recall_pages, host)
    demotes = parse_demote_pages(demote_pages)
    plans = parse_plan_recall(plan_recall)
    lm, tok = _checked_and_loaded(scorer, device, model, threads, as_json)

    from transformers import DynamicCache

    from ..bench.launches import count_launches, time_cache_host, time_decode_graph_host
    from ..integrations.layers import TIERED, layer_plan

    if TIERED not in layer_plan(lm.config).kinds:
        raise bad_option("--model", model, "a model with full-attention layers",
                         "has none: every layer keeps its sliding window, so a TieredCache tiers nothing to count")
    from ..integrations.hf import TieredCache
    from ..tasks.needle import make_needle_task

    task = make_needle_task(tok, tokens, depth=0.3, seed=seed)
    ids = task.input_ids.to(device)

    def tiered(demote: int | None, plan: str) -> TieredCache:
        # on CUDA, eager steps: a replayed graph dispatches nothing the counter could see
        cache = TieredCache(lm.config, device_budget=budget, host_budget=host, recall_pages=recall_pages,
                            demote_pages=demote, scorer=None if scorer == "auto" else scorer, cuda_graphs=False)
        cache.take_gpu_path(plan_on_device=plan == "device")   # pages chosen, entries scored and checked as on a GPU
        for engine in cache._engines:
            engine.prefetch_in_step = prefetch_at == "in-step"
        return cache

    makers = {"DynamicCache": lambda: DynamicCache(config=lm.config)}
    makers.update({tiered_row_name(d, len(demotes), plan=p, plan_rows=len(plans)): (lambda d=d, p=p: tiered(d, p))
                   for d in demotes for p in plans})
    rows = [count_launches(lm, ids, make, name, steps)[0] for name, make in makers.items()]
    for row, make in zip(rows, makers.values()):   # timed apart: the counter's dispatch would weigh on the time
        row.host_us, row.captured_host_us, row.key_host_us = time_cache_host(lm, ids, make, steps)
    # the host's part of a step replayed whole (DecodeGraph), for the first kvtier row's settings
    whole = time_decode_graph_host(lm, ids, list(makers.values())[1], steps)
    out = {"machine": _machine(device), "prompt_tokens": task.prompt_tokens, "steps": steps,
           "settings": {"device_budget": budget, "host_budget": host, "recall_pages": recall_pages,
                        "scorer": scorer, "seed": seed, "prefetch": prefetch_at, "plan_recall": plans},
           "rows": [r.as_dict() for r in rows],
           "decode_graph_host_us_per_layer_step": whole,
           "ratio": round(rows[1].total / max(1, rows[0].total), 2)}
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(f"\n{task.prompt_tokens:,}-token prompt, {steps} decode steps counted, device budget {budget}, "
               + ("" if host is None else f"host budget {host}, ")
               + f"{recall_pages} pages recalled per layer and KV head")
    for r in out["rows"]:
        click.echo(f"  {r['cache']:<14}{r['launches_per_layer_step']:>8.1f} launches per layer and step, "
                   f"{r['cache_host_us_per_layer_step']:.1f} us of host time in the cache's code")
        for part, n in r["by_part_per_layer_step"].items():
            click.echo(f"      {part:<28}{n:>8.1f}")
        if r["launches_per_demotion"] is not None:
            click.echo(f"      a layer's demotion ({r['demotions']} in the steps counted): "
                       f"{r['launches_per_demotion']:.1f} launches, of which {r['native_calls_per_demotion']:.1f} "
                       "native calls")
        if r["captured_launches_per_layer_step"] is not None:
            click.echo(f"      of all: in the work a CUDA graph replays (cuda_graphs=True): "
                       f"{r['captured_launches_per_layer_step']:.1f} launches, "
                       f"{r['captured_host_us_per_layer_step']:.1f} us of host time; the replay's keys "
                       f"{r['graph_key_host_us_per_layer_step']:.1f} us beside it")
    if whole["planned_steps"]:
        click.echo(f"  a step replayed whole (DecodeGraph) costs the host, per layer: plan {whole['plan']:.1f} us, "
                   f"key {whole['key']:.1f} us, take {whole['take']:.1f} us ({whole['planned_steps']} of {steps} "
                   f"steps planned, in {whole['states']} states: a capture each on a GPU; {whole['demotions']} "
                   "demotions)")
    else:
        click.echo(f"  a step replayed whole (DecodeGraph): none of the {steps} steps could be planned whole (they ran "
                   "the ordinary way), so there is no figure")
    click.echo(f"  TieredCache / DynamicCache: x{out['ratio']:.2f} launches")


@bench.command("wrappers")
@click.option("--contexts", default="128K,1M", show_default=True,
              help="Comma list of contexts whose decode-step shapes the calls are made at (e.g. 128K,1M).")
@click.option("--device-budget", default=0.1, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True),
              help="Fraction of the context on the device.")
@click.option("--calls", default=2000, show_default=True, type=click.IntRange(min=10),
              help="Calls timed per run (five runs, the median kept).")
@click.option("--threads", default=1, show_default=True, type=THREADS, help="torch CPU threads.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@user_errors
def wrappers(contexts: str, device_budget: float, calls: int, threads: int, as_json: bool) -> None:
    """Host microseconds of kvtier's own code per native kernel call (checks, allocations, launch arguments;
    the launch itself left out), at the decode shapes of the Llama-3.1-8B shape, next to a torch op's."""
    from ..bench.wrappers import measure_wrapper_cost
    from .common import parse_context, split_list

    set_threads(threads)
    ctx = [parse_context(c, "--contexts", 1024, BENCH_MAX_CONTEXT) for c in split_list(contexts, "--contexts")]
    out = {"machine": _machine("cpu"), **measure_wrapper_cost(ctx, device_budget, calls)}
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    ops = list(out["calls_per_layer_step"])
    click.echo(f"\nhost us per call (launch left out), {out['settings']['device_budget']:g} of the context on the "
               f"device; a torch op here: {out['torch_op_us']:.2f} us")
    click.echo(f"  {'context':>9}  " + "  ".join(f"{op:>17}" for op in ops) + "  per layer-step  in torch ops")
    for r in out["rows"]:
        click.echo(f"  {r['context']:>9,}  " + "  ".join(f"{r['us_per_call'][op]:>17.2f}" for op in ops)
                   + f"  {r['us_per_layer_step']:>14.1f}  {r['torch_ops_per_layer_step']:>12.1f}")
    click.echo("  calls per layer-step: " + ", ".join(f"{op} x{n}" for op, n in out["calls_per_layer_step"].items()))


def _fraction(value: str, option: str) -> float:
    """A fraction strictly between 0 and 1, or a clear refusal naming `option`."""
    try:
        got = float(value)
    except ValueError:
        raise bad_option(option, value, "a fraction between 0 and 1, like 0.5, or none", "is not a number") from None
    if not 0 < got < 1:
        raise bad_option(option, value, "a fraction between 0 and 1, like 0.5, or none", "is out of range")
    return got


@bench.command("gpu")
@click.option("--contexts", default="32K,128K", show_default=True,
              help="Comma list of prefilled contexts whose decode step is timed (e.g. 32K,128K).")
@click.option("--million/--no-million", default=True, show_default=True,
              help="The synthetic 1M-token row (filled through the cache's update, no prefill).")
@click.option("--million-context", default="1M", show_default=True, help="Tokens of the synthetic row.")
@click.option("--million-layers", default="auto", show_default=True,
              help="Layers filled in the synthetic row (auto: as host memory allows, at most 8; reported "
                   "and projected to the shape's layers).")
@click.option("--device-budget", default="0.1", show_default=True,
              help="kvtier's device tokens per KV head: a fraction or a token count.")
@click.option("--recall-pages", default=64, show_default=True, type=click.IntRange(min=0),
              help="Pages recalled per layer and KV head per step.")
@click.option("--layers", default=None, type=click.IntRange(min=1),
              help="Model layers (default: the shape's own, 32 for the 8B shape; fewer is quicker and is "
                   "reported as a truncated shape).")
@click.option("--shape", default="llama-3.1-8b", show_default=True, type=click.Choice(["llama-3.1-8b", "tiny"]),
              help="Model shape (random weights); tiny is for tests.")
@click.option("--steps", default=10, show_default=True, type=click.IntRange(min=1),
              help="Timed decode steps per row (after the warm-up); the median is reported.")
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(min=0),
              help="Untimed decode steps first.")
@click.option("--growth-steps", default=1000, show_default=True, type=click.IntRange(min=0),
              help="kvtier decode steps at the smallest context over which memory growth is measured (0: skip).")
@click.option("--growth-seconds", default=120.0, show_default=True, type=click.FloatRange(min=0),
              help="Stop the growth run past this many seconds (recorded; the target then has no verdict).")
@click.option("--time-limit", default=285.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds the whole command may take, start-up included: the memory-growth run comes last and "
                   "stops in time to keep to them (0: no limit).")
@click.option("--prefill-chunk", default=8192, show_default=True, type=click.IntRange(min=1),
              help="Tokens per prefill forward (keeps activation memory small).")
@click.option("--copy-mib", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Size of the raw pinned copy the batches are compared with.")
@click.option("--batch-mib", default=64, show_default=True, type=click.IntRange(min=1),
              help="Size of the demotion and recall batches timed through the engine.")
@click.option("--eager-row/--no-eager-row", "eager", default=True, show_default=True,
              help="Also time kvtier with CUDA graphs off, its decode steps' launches issued one by one (at each "
                   "context; the kvtier row is the cache as made by default, on CUDA replayed from graphs).")
@click.option("--decode-graph-row/--no-decode-graph-row", "decode_graph", default=True, show_default=True,
              help="Also time kvtier stepped by DecodeGraph: the model's decode step and the cache's captured as one "
                   "CUDA graph and replayed where the step is steady (at each context, and the 1M row).")
@click.option("--sustained-steps", default=300, show_default=True, type=click.IntRange(min=0),
              help="After the DecodeGraph row's timed steps, this many more at each context (stopped at "
                   "--growth-seconds), demotions and the captures after them included: the mean step of a long "
                   "decode (0: none).")
@click.option("--no-prefetch-row/--skip-no-prefetch-row", "no_prefetch", default=True, show_default=True,
              help="Also time kvtier without prefetch (prefetch_pages=0), and with its prefetch on the side stream "
                   "rather than in each step's CUDA graph, at the largest context.")
@click.option("--disk-host-budget", default="0.5", show_default=True,
              help="Also time kvtier with this host budget (a fraction of the context: past it pages go to disk), "
                   "recall planned on the device and on the host, at the smallest context (none: no disk rows).")
@click.option("--profile-steps", default=0, show_default=True, type=click.IntRange(min=0),
              help="After each kvtier row's timed steps, this many more under cProfile: where the host time of a "
                   "step goes (JSON 'host_profile'; 0: none).")
@click.option("--device", default="cuda", show_default=True,
              help="cuda, cuda:N, or cpu (the same code at the sizes asked, plain memory, wall-clock timing).")
@click.option("--threads", default=None, type=THREADS, help="torch CPU threads (default: torch's own).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--out", "out_path", default="kvtier-bench-gpu.json", show_default=True, help="Where the JSON goes.")
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
@user_errors
def gpu(contexts: str, million: bool, million_context: str, million_layers: str, device_budget: str,
        recall_pages: int, layers: int | None, shape: str, steps: int, warmup: int, growth_steps: int,
        growth_seconds: float, time_limit: float, prefill_chunk: int, copy_mib: int, batch_mib: int, eager: bool,
        decode_graph: bool, sustained_steps: int, no_prefetch: bool, disk_host_budget: str, profile_steps: int,
        device: str, threads: int | None, seed: int, out_path: str, quiet: bool) -> None:
    """Demotion/recall GB/s vs a raw pinned copy; decode step of the Llama-3.1-8B shape (random weights, bf16,
    batch 1) with kvtier vs DynamicCache on the GPU vs DynamicCache(offloading=True); a synthetic 1M row; KVP
    scoring as a fraction of prefill. Prints a table and writes JSON with each target's pass/fail."""
    from pathlib import Path

    from .common import bad_option, check_output_file, parse_context, split_list

    ctx = tuple(sorted({parse_context(c, "--contexts", 16, BENCH_MAX_CONTEXT)
                        for c in split_list(contexts, "--contexts")}))
    budget = parse_budget(device_budget, "--device-budget")
    if budget is None:
        raise bad_option("--device-budget", device_budget, "a fraction like 0.1 or a token count like 4096",
                         "leaves no device tier")
    check_cache_options(budget, None, None, recall_pages)
    m_ctx = parse_context(million_context, "--million-context", 16, BENCH_MAX_CONTEXT)
    disk_host = None if disk_host_budget.strip().lower() == "none" else _fraction(disk_host_budget,
                                                                                   "--disk-host-budget")
    if million_layers.strip().lower() == "auto":
        m_layers = None
    else:
        try:
            m_layers = int(million_layers)
        except ValueError:
            raise bad_option("--million-layers", million_layers, "auto or a whole number >= 1",
                             "is not a whole number") from None
        if m_layers < 1:
            raise bad_option("--million-layers", million_layers, "auto or a whole number >= 1", "is out of range")
    from ..bench.gpu import SHAPES, GpuBenchConfig, Progress, format_report, run_gpu_bench

    if layers is not None and layers > SHAPES[shape]["num_hidden_layers"]:
        raise bad_option("--layers", layers, f"1 to {SHAPES[shape]['num_hidden_layers']} for {shape}", "is too many")
    check_device(device)
    out_path = check_output_file(out_path, "--out")
    if threads is not None:
        set_threads(threads)
    cfg = GpuBenchConfig(device=device, shape=shape, layers=layers, contexts=ctx, million=million,
                         million_context=m_ctx, million_layers=m_layers, device_budget=budget,
                         recall_pages=recall_pages, steps=steps, warmup=warmup, growth_steps=growth_steps,
                         growth_seconds=growth_seconds, time_limit=time_limit or None, prefill_chunk=prefill_chunk,
                         copy_mib=copy_mib, batch_mib=batch_mib, eager=eager, decode_graph=decode_graph,
                         sustained_steps=sustained_steps, no_prefetch=no_prefetch, disk_host_budget=disk_host,
                         profile_steps=profile_steps, seed=seed)
    out_file = Path(out_path).expanduser()
    out_file.parent.mkdir(parents=True, exist_ok=True)   # the first checkpoint comes after minutes of work

    def write(result: dict) -> None:   # whole or not at all: a run killed mid-write keeps the last checkpoint
        tmp = out_file.with_name(out_file.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(out_file)

    result = run_gpu_bench(cfg, Progress(not quiet), checkpoint=write, started=command_started())
    write(result)
    click.echo(format_report(result))
    click.echo(f"JSON: {out_path}")
