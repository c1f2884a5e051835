"""`kvtier traces`, `kvtier train`, `kvtier eval-scorer`: make and judge a KVP scorer."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import click

from ..scoring.kvp import MODEL_SIGNATURE
from ..training.collect import NEEDLE_SEEDS
from .common import (THREADS, check_model, check_output_file, check_writable_folder, load,
                     parse_fractions, parse_ints, read_manifest, set_threads, user_errors)


def _bar(desc: str, quiet: bool = False):
    from tqdm import tqdm

    return lambda it: tqdm(it, desc=desc, disable=quiet)


@click.command()
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for the trace shards.")
@click.option("--model", default=None, help="A Hugging Face id or local path (default: the packaged model).")
@click.option("--split", type=click.Choice(["train", "eval"]), default="train", show_default=True,
              help="Which half of the corpus (and which task seeds) to use; the two never overlap.")
@click.option("--texts", default=48, show_default=True, type=click.IntRange(min=0),
              help="Prose traces (continuation = the text itself).")
@click.option("--needles", default=16, show_default=True, type=click.IntRange(0, NEEDLE_SEEDS),
              help="Needle-task traces (continuation = greedy answer).")
@click.option("--prompt-tokens", default="1024", show_default=True,
              help="Prompt length of the prose traces, or a comma list taken in turn (e.g. 512,1024,2048,3072): "
                   "several lengths let the scorer tell an entry's age from its position.")
@click.option("--continuation-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--needle-context", default="1500", show_default=True,
              help="Haystack length of the needle traces in tokens, or a comma list taken in turn (each >= 256).")
@click.option("--chats", default=0, show_default=True, type=click.IntRange(min=0),
              help="Multi-turn conversation traces: a fact, turns of prose with the model's own sampled replies, "
                   "then a question about the fact (continuation = greedy answer).")
@click.option("--chat-context", default="4096", show_default=True,
              help="Length of the conversations in tokens, or a comma list taken in turn (each >= 512).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, NEEDLE_SEEDS - 1),
              help="Seed of the windows and tasks; the two splits' needle tasks never overlap for any of them.")
@click.option("--threads", default=2, show_default=True, type=THREADS)
@click.option("--corpus", type=click.Choice(["stdlib", "packages", "both"]), default="stdlib", show_default=True,
              help="Prose for the text traces: the standard library's docstrings, the documentation installed "
                   "packages ship (license texts kept out), or both.")
@user_errors
def traces(out: str, model: str | None, split: str, texts: int, needles: int, prompt_tokens: str,
           continuation_tokens: int, needle_context: str, chats: int, chat_context: str, seed: int, threads: int,
           corpus: str) -> None:
    """Record generation traces (keys, values, positions, future attention) for training KVP."""
    if texts == 0 and needles == 0 and chats == 0:
        raise click.BadParameter("0 with --texts 0 and --chats 0: nothing to record; allowed: --texts, --needles "
                                 "or --chats above 0",
                                 param_hint="'--needles'")
    lengths = parse_ints(prompt_tokens, "--prompt-tokens", low=64)
    contexts = parse_ints(needle_context, "--needle-context", low=256)
    chat_lengths = parse_ints(chat_context, "--chat-context", low=512)
    out = check_writable_folder(out, "--out")
    check_model(model)

    from ..models import DEFAULT_MODEL_NAME
    from ..training.collect import record_folder

    set_threads(threads)
    lm, tok = load(model)
    start = time.perf_counter()
    manifest = record_folder(lm, tok, out, model_name=model or DEFAULT_MODEL_NAME, split=split, texts=texts,
                             needles=needles, prompt_tokens=lengths, continuation_tokens=continuation_tokens,
                             needle_context=contexts, answer_tokens=32, seed=seed,
                             progress=_bar("traces"), corpus=corpus,
                             chats=chats, chat_context=chat_lengths)
    click.echo(f"{len(manifest['traces'])} traces in {out} ({time.perf_counter() - start:.0f} s)")


@click.command()
@click.option("--traces", "trace_dirs", required=True, multiple=True, type=click.Path(exists=True, file_okay=False),
              help="A folder written by `kvtier traces`; repeat it to train on several folders of the same model.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Weights file (.safetensors).")
@click.option("--objective", type=click.Choice(["reinforce", "listwise"]), default="reinforce", show_default=True)
@click.option("--steps", default=300, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**64 - 1))
@click.option("--threads", default=2, show_default=True, type=THREADS)
@click.option("--importance", type=click.Choice(["importance", "importance_next", "importance_decay",
                                                 "importance_value"]), default="importance", show_default=True,
              help="The target: future attention over the whole continuation (the paper's), its first 16 steps, "
                   "steps discounted by exp(-t/32), or attention times the value norm (docs/scorer-objective.md).")
@click.option("--lr", default=3e-3, show_default=True, type=click.FloatRange(min=0, min_open=True, max=1),
              help="Learning rate of the network (the recency table learns 10x faster).")
@click.option("--age-only", "age_only", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Start from these KVP weights and train only their recency term (the network frozen).")
@click.option("--top-tokens", default=0, show_default=True, type=click.IntRange(min=0),
              help="Put each trace's N most important entries (largest share of some head's attention) in every "
                   "ranking problem drawn from it, beside random ones (384 in all, so at most 384).")
@user_errors
def train(trace_dirs: tuple[str, ...], out: str, objective: str, steps: int, seed: int, threads: int,
          importance: str, lr: float, age_only: str | None, top_tokens: int) -> None:
    """Train KVP agents on recorded traces; keeps the checkpoint with the best held-out reward."""
    seen: dict[str, str] = {}
    for folder in trace_dirs:   # a folder given twice would put copies of training traces in the held-out share
        real = os.path.realpath(folder)
        if real in seen:
            raise click.BadParameter(f"{folder!r} is given twice (as {seen[real]!r} before); allowed: each folder "
                                     "once", param_hint="'--traces'")
        seen[real] = folder
    manifests = [read_manifest(folder, split="train") for folder in trace_dirs]
    first = manifests[0]
    for folder, other in zip(trace_dirs[1:], manifests[1:]):   # one model, whatever name it was recorded under
        differ = [k for k in MODEL_SIGNATURE if k in other and k in first and other[k] != first[k]]
        if differ:
            raise click.BadParameter(
                f"{folder!r} was recorded with {', '.join(f'{k}={other[k]!r}' for k in differ)}, {trace_dirs[0]!r} "
                f"with {', '.join(f'{k}={first[k]!r}' for k in differ)}; allowed: folders of one model",
                param_hint="'--traces'")
    out = check_output_file(out, "--out")

    from ..errors import ConfigError
    from ..scoring.kvp import load_agents, save_agents
    from ..training.dataset import load_folder
    from ..training.train import TrainSettings, train_agents

    try:
        settings = TrainSettings(objective=objective, steps=steps, seed=seed, lr=lr, top_tokens=top_tokens)
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="'--top-tokens'") from e
    base, base_meta = (None, {}) if age_only is None else load_agents(age_only)
    differ = [k for k in MODEL_SIGNATURE if k in base_meta and k in first and base_meta[k] != first[k]]
    if differ:
        raise click.BadParameter(
            f"{age_only!r} holds agents of model {base_meta.get('model')!r} "
            f"({', '.join(f'{k}={base_meta[k]!r}' for k in differ)}); the traces are of {first.get('model')!r} "
            f"({', '.join(f'{k}={first[k]!r}' for k in differ)}); allowed: weights of the traces' model",
            param_hint="'--age-only'")
    set_threads(threads)
    data, corpora, sources = [], [], set()
    for folder, manifest in zip(trace_dirs, manifests):
        part, traces = load_folder(folder, importance=importance, manifest=manifest)
        data += traces
        corpora += [c for c in [part.get("corpus", "unknown")] if c not in corpora]
        sources |= {t["continuation"] for t in part["traces"]}
    start = time.perf_counter()
    agents, report = train_agents(data, first["head_dim"], settings, progress=_bar(f"train ({objective})"),
                                  age_only=base)
    meta = {k: first[k] for k in ("model", "num_layers", "num_kv_heads", "head_dim", "hidden_size",
                                  "vocab_size") if k in first}
    meta.update(objective=objective, importance=importance, training_data=f"{len(data)} traces from "
                f"{', '.join(Path(d).name for d in trace_dirs)} "
                f"({'; '.join(corpora)}; needle tasks; continuations: {', '.join(sorted(sources))})",
                best_step=report["best_step"], best_val_reward=report["best_val_reward"], kvtier_version="0.1.0",
                settings=report["settings"])
    if base is not None:   # the network is the one given: keep its record, and say what was trained here
        base_meta.pop("calibration", None)   # the recency term it describes is the one trained here
        meta = {**base_meta,   # save_agents writes format version and sizes afresh
                "age_term": {"trained_on": meta["training_data"], "objective": objective, "importance": importance,
                             "best_step": report["best_step"], "best_val_reward": report["best_val_reward"],
                             "settings": report["settings"]}}
    Path(out).absolute().parent.mkdir(parents=True, exist_ok=True)   # only now: a run cut short leaves nothing
    save_agents(agents, out, meta)
    Path(out).with_suffix(".report.json").write_text(json.dumps(report, indent=2))
    click.echo(f"best held-out reward {report['best_val_reward']:.4f} at step {report['best_step']} "
               f"({time.perf_counter() - start:.0f} s); weights in {out}")


@click.command()
@click.option("--kvp", "kvp_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="KVP weights made by `kvtier train`.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Calibrated weights (.safetensors).")
@click.option("--model", default=None, help="A Hugging Face id or local path (default: the packaged model).")
@click.option("--texts", default=4, show_default=True, type=click.IntRange(min=1),
              help="Training-split prose windows, taken in turn at each of --lengths.")
@click.option("--lengths", default="2048,4096", show_default=True, help="Comma list of prompt lengths.")
@click.option("--needles", default=4, show_default=True, type=click.IntRange(0, NEEDLE_SEEDS),
              help="Training-split needle tasks, scored on the full cache's own answer: recency that loses a fact "
                   "costs there what it gains on prose.")
@click.option("--needle-context", default="1500,4096", show_default=True,
              help="Haystack lengths of the needle tasks, a comma list taken in turn (each >= 256).")
@click.option("--slopes", default="0,2,4,6,10,16", show_default=True,
              help="Comma list of extra recency slopes to try (each lowers the term by slope x ln(1 + age)).")
@click.option("--budgets", default="0.05,0.1,0.25", show_default=True, help="Comma list of device budgets.")
@click.option("--corpus", type=click.Choice(["stdlib", "packages", "both"]), default="both", show_default=True)
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, NEEDLE_SEEDS - 1),
              help="Seed of the windows and tasks; the two splits' needle tasks never overlap for any of them.")
@click.option("--threads", default=2, show_default=True, type=THREADS)
@user_errors
def calibrate(kvp_path: str, out: str, model: str | None, texts: int, lengths: str, needles: int,
              needle_context: str, slopes: str, budgets: str, corpus: str, seed: int, threads: int) -> None:
    """Choose how much recency KVP adds, by the continuation loss under eviction on training prose and needles."""
    prompt_lengths = parse_ints(lengths, "--lengths", low=64)
    haystacks = parse_ints(needle_context, "--needle-context", low=256)
    fractions = parse_fractions(budgets, "--budgets")
    try:
        slope_values = tuple(float(x) for x in slopes.split(","))
    except ValueError:
        slope_values = ()
    if not slope_values or any(not math.isfinite(x) or x < 0 for x in slope_values):
        raise click.BadParameter(f"{slopes!r}; allowed: a comma list of numbers >= 0, e.g. 0,1,2,3",
                                 param_hint="'--slopes'")
    out = check_output_file(out, "--out")
    check_model(model)

    from ..config import ModelShape
    from ..models import load_config
    from ..scoring import check_scorer_model
    from ..scoring.kvp import KVPScorer, load_agents, save_agents
    from ..training.calibrate import calibrate_recency, with_slope
    from ..training.collect import needle_prompts, text_chunks

    set_threads(threads)
    agents, meta = load_agents(kvp_path)
    config = load_config(model)   # refuse another model's weights before the slow load
    shape = ModelShape.from_config(config)
    check_scorer_model(KVPScorer.from_agents(agents, meta), shape.num_layers, shape.num_kv_heads, shape.head_dim,
                       config)
    lm, tok = load(model)
    start = time.perf_counter()
    windows = text_chunks(tok, "train", prompt_lengths, 256, texts, seed, corpus)
    windows += needle_prompts(lm, tok, "train", haystacks, needles, 32, seed)
    result = calibrate_recency(lm, agents, meta, [(p, c) for _, p, c in windows], slopes=slope_values,
                               budgets=fractions, progress=_bar("calibrate"))
    meta["calibration"] = {"slope": result.slope, "nll": {f"{k:g}": v for k, v in result.nll.items()},
                           "texts": [name for name, _, _ in windows], "budgets": list(fractions)}
    Path(out).absolute().parent.mkdir(parents=True, exist_ok=True)
    save_agents(with_slope(agents, result.slope), out, meta)
    for slope, nll in result.nll.items():
        click.echo(f"slope {slope:g}: mean continuation NLL {nll:.4f}" + ("  <- chosen" if slope == result.slope else ""))
    click.echo(f"calibrated weights in {out} ({time.perf_counter() - start:.0f} s)")


@click.command("eval-scorer")
@click.option("--traces", "trace_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="Held-out traces (recorded with --split eval).")
@click.option("--kvp", "kvp_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="KVP weights (default: the shipped ones for the model).")
@click.option("--budgets", default="0.1,0.25,0.5", show_default=True, help="Comma list of fractions in (0, 1].")
@click.option("--markdown", default=None, help="Write the table (and a PNG plot beside it) to this file.")
@click.option("--json", "as_json", is_flag=True)
@click.option("--importance", type=click.Choice(["importance", "importance_next", "importance_decay",
                                                 "importance_value"]), default="importance", show_default=True,
              help="The target: future attention over the whole continuation (the paper's), its first 16 steps, "
                   "steps discounted by exp(-t/32), or attention times the value norm (docs/scorer-objective.md).")
@user_errors
def eval_scorer(trace_dir: str, kvp_path: str | None, budgets: str, markdown: str | None, as_json: bool,
                importance: str) -> None:
    """Share of future attention mass each scorer keeps, per budget, on held-out traces."""
    manifest = read_manifest(trace_dir, split="eval")
    fractions = parse_fractions(budgets, "--budgets")
    if markdown:
        markdown = check_output_file(markdown, "--markdown")

    from ..scoring.kvp import SHIPPED, KVPScorer, shipped_matching
    from ..scoring import BASELINES_ATTENTION_BASED, BASELINES_ATTENTION_FREE
    from ..training.evaluate import evaluate_scorers
    from ..training.report import write_scorer_report
    from ..training.traces import load_trace

    if kvp_path is None:   # the shipped weights of the traces' model: by its name, else by its sizes
        shipped = manifest["model"] if manifest["model"] in SHIPPED else \
            shipped_matching({k: manifest.get(k) for k in MODEL_SIGNATURE})
        if shipped is None:
            raise click.BadParameter(
                f"no KVP weights ship for the traces' model {manifest['model']!r} "
                f"({', '.join(f'{k}={manifest.get(k)!r}' for k in MODEL_SIGNATURE)}); allowed: --kvp FILE, weights "
                "made for it by `kvtier train`", param_hint="'--kvp'")
        kvp = KVPScorer(model=shipped)
    else:
        kvp = KVPScorer(path=kvp_path, model=manifest["model"])
    kvp.check_model(manifest["num_layers"], manifest["num_kv_heads"], manifest["head_dim"])
    kvp.check_sizes(manifest.get("hidden_size"), manifest.get("vocab_size"))
    raws = [load_trace(Path(trace_dir) / t["file"]) for t in manifest["traces"]]
    result = evaluate_scorers(raws, ["kvp", *BASELINES_ATTENTION_FREE, *BASELINES_ATTENTION_BASED],
                              list(fractions), kvp, progress=_bar("eval", as_json), importance=importance)
    result["kvp"] = {k: kvp.meta.get(k) for k in ("model", "objective", "training_data", "best_val_reward")}
    if markdown:
        Path(markdown).absolute().parent.mkdir(parents=True, exist_ok=True)
        write_scorer_report(result, markdown, command=f"kvtier eval-scorer --traces {trace_dir}"
                            + (f" --kvp {kvp_path}" if kvp_path else "")
                            + (f" --importance {importance}" if importance != "importance" else ""))
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    bs = result["budgets"]
    click.echo("scorer      " + "".join(f"{b:>9.0%}" for b in bs))
    for name, row in result["mean"].items():
        click.echo(f"{name:<12}" + "".join(f"{row[str(b)]:>9.3f}" for b in bs))
