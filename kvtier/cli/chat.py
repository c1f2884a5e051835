"""`kvtier chat`: talk to the model through a tiered cache, with memory per tier after every turn."""

from __future__ import annotations

import json
import sys

import click

from .common import (DEVICE_HELP, THREADS, check_cache_options, check_chat_template, check_model, load, parse_budget,
                     resolve_device, set_threads, user_errors)
from .format import human_bytes


@click.command()
@click.option("--device-budget", default="0.25", show_default=True, help="Device tokens per KV head.")
@click.option("--host-budget", default="0.5", show_default=True, help="Host tokens per KV head ('none' = no limit).")
@click.option("--park", "park_to", type=click.Choice(["none", "host", "disk"]), default="host", show_default=True,
              help="Where the conversation's cache waits while you type.")
@click.option("--max-new-tokens", default=200, show_default=True, type=click.IntRange(min=1))
@click.option("--system", default=None, help="A system message.")
@click.option("--disk-dir", default=None, help="Folder for the disk tier (default: a temporary folder).")
@click.option("--model", default=None, help="A Hugging Face id or local path (default: the packaged model).")
@click.option("--decode-graph", is_flag=True,
              help="Step each reply through DecodeGraph: on CUDA, each steady decode step (the model's launches and "
                   "the cache's) replayed as one CUDA graph; the same replies. Steps replay while every demoted page "
                   "is in host memory: with --host-budget none, or until a layer first spills pages to disk.")
@click.option("--device", default="auto", show_default=True, help=DEVICE_HELP)
@click.option("--threads", default=1, show_default=True, type=THREADS)
@click.option("--json", "as_json", is_flag=True, help="One JSON line per turn instead of text.")
@user_errors
def chat(device_budget: str, host_budget: str, park_to: str, max_new_tokens: int, system: str | None,
         disk_dir: str | None, model: str | None, decode_graph: bool, device: str, threads: int,
         as_json: bool) -> None:
    """Interactive multi-turn chat on the tiered cache (empty line or /quit to stop)."""
    budget, host = parse_budget(device_budget, "--device-budget"), parse_budget(host_budget, "--host-budget")
    disk_dir = check_cache_options(budget, host, disk_dir)
    where = resolve_device(device)
    check_model(model)
    set_threads(threads)
    lm, tok = load(model, quiet=as_json, device=where)
    check_chat_template(tok, model)

    from ..integrations.chat import ChatSession

    session = ChatSession(lm, tok, system=system, device_budget=budget, host_budget=host, disk_dir=disk_dir,
                          decode_graph=decode_graph)
    stdin = sys.stdin
    turn = 0
    try:
        while True:
            if not as_json:
                click.echo("you> ", nl=False)
            line = stdin.readline()
            if not line or line.strip() in ("", "/quit", "/exit"):
                break
            reply = session.ask(line.strip(), max_new_tokens=max_new_tokens)
            turn += 1
            if park_to != "none":
                session.park(park_to)
            s = session.cache.stats()
            per = max(s["layers"] * s["kv_heads"], 1)   # a model of sliding-window layers only tiers none
            if as_json:   # the conversation's tokens, and each tier's per layer and KV head, as the text shows them
                click.echo(json.dumps({"turn": turn, "reply": reply, "tokens": s["tokens_seen"],
                                       **{t: {"tokens_per_head": s[t]["tokens"] // per, "bytes": s[t]["bytes"]}
                                          for t in ("device", "host", "disk")}, "parked": s["parked"],
                                       **({"decode_graph": session.decode_graph.stats()}
                                          if session.decode_graph is not None else {})}))
                continue
            click.echo(f"model> {reply}")
            tiers = "  ".join(f"{t} {s[t]['tokens'] // per:,} tok/head ({human_bytes(s[t]['bytes'])})"
                              for t in ("device", "host", "disk"))
            click.echo(click.style(f"  [turn {turn}: {s['tokens_seen']:,} tokens | {tiers}"
                                   f"{' | parked on ' + s['parked'] if s['parked'] else ''}]", dim=True))
    finally:
        session.cache.close()
