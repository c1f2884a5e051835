"""`kvtier eval` and `kvtier report`: accuracy and perplexity across policies, budgets and lengths."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import click

from .common import (DEVICE_HELP, EXIT_RUNTIME, THREADS, check_model, check_output_file, check_policies, load,
                     parse_fractions, parse_ints, read_result_lines, resolve_device, set_threads, split_list,
                     user_errors)

MIN_LENGTH = 256  # the shortest prompt an evaluation task is built for


@click.command("eval")
@click.option("--suite", type=click.Choice(["quick", "standard", "full"]), default="quick", show_default=True)
@click.option("--out", default="results.jsonl", show_default=True, help="JSON lines; an existing file is resumed.")
@click.option("--model", default=None, help="A Hugging Face id or local path (default: the packaged model).")
@click.option("--policies", default=None, help="Comma list: full, evict:<scorer>, tier:<scorer>, tier-all:<scorer>.")
@click.option("--budgets", default=None, help="Comma list of device budgets (fractions).")
@click.option("--lengths", default=None, help="Comma list of prompt lengths in tokens.")
@click.option("--tasks", default=None, help="Comma list of tasks.")
@click.option("--seed", "seeds", default=None, help="Comma list of seeds.")
@click.option("--device", default="auto", show_default=True, help=DEVICE_HELP)
@click.option("--threads", default=1, show_default=True, type=THREADS)
@click.option("--json", "as_json", is_flag=True, help="Print a summary as JSON.")
@user_errors
def evaluate(suite: str, out: str, model: str | None, policies: str | None, budgets: str | None,
             lengths: str | None, tasks: str | None, seeds: str | None, device: str, threads: int,
             as_json: bool) -> None:
    """Run an evaluation suite (resumable); exits 3 if tier mode with full recall departs from the full cache."""
    from tqdm import tqdm

    from ..eval.report import aggregate
    from ..eval.runner import SUITES, check_same_model, full_recall_mismatches, mend_last_line, run_suite
    from ..eval.tasks import TASKS
    from ..models import DEFAULT_MODEL_NAME

    chosen = SUITES[suite]
    chosen = replace(chosen, **{k: v for k, v in {
        "policies": None if policies is None else tuple(split_list(policies, "--policies")),
        "budgets": parse_fractions(budgets, "--budgets"),
        "lengths": parse_ints(lengths, "--lengths", MIN_LENGTH),
        "tasks": None if tasks is None else tuple(split_list(tasks, "--tasks")),
        "seeds": parse_ints(seeds, "--seed", 0)}.items() if v is not None})
    check_policies(chosen.policies)
    unknown = [t for t in chosen.tasks if t not in TASKS]
    if unknown:
        raise click.BadParameter(f"{', '.join(map(repr, unknown))} is not a task; allowed: {', '.join(TASKS)}",
                                 param_hint="'--tasks'")
    out = check_output_file(out, "--out")
    if Path(out).is_file():  # resumed: a damaged file fails now, not after the model has loaded
        mended = mend_last_line(out)
        if mended:
            click.echo(f"kvtier: warning: {mended}", err=True)
        check_same_model(read_result_lines(out, "--out"), model or DEFAULT_MODEL_NAME, out)
    where = resolve_device(device)
    check_model(model)
    set_threads(threads)
    start = time.perf_counter()
    lm, tok = load(model, quiet=as_json, device=where)
    results = run_suite(lm, tok, out, chosen, progress=lambda it: tqdm(it, desc=f"eval {suite}", disable=as_json),
                        name=model or DEFAULT_MODEL_NAME)
    bad = full_recall_mismatches(results)
    seconds = time.perf_counter() - start
    summary = {"runs": len(results), "out": out, "seconds": round(seconds, 1), "full_recall_mismatches": bad,
               "mean": {t: {p: {str(b): v for b, v in row.items()} for p, row in pol.items()}
                        for t, pol in aggregate(results).items()}}
    failure = (f"{len(bad)} result(s) of tier mode with full recall depart from the full cache (see "
               f"full_recall_mismatches in {out})") if bad else None
    if as_json:
        if failure:
            summary.update(error=failure, exit_code=EXIT_RUNTIME)
        click.echo(json.dumps(summary, indent=2))
    else:
        click.echo(f"{len(results)} runs in {out}; {seconds / 60:.1f} min (model load included)")
        for line in bad:
            click.echo(f"MISMATCH (tier with full recall vs full cache): {line}")
    if failure:
        click.echo(f"kvtier: error: {failure}", err=True)
        sys.exit(EXIT_RUNTIME)


@click.command()
@click.argument("results", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", default="docs/results.md", show_default=True, help="Markdown file (a PNG is written beside it).")
@click.option("--note", default="", help="A paragraph placed under the title (machine, wall time, ...).")
@user_errors
def report(results: str, out: str, note: str) -> None:
    """Markdown tables and plots of an evaluation's results."""
    records = read_result_lines(results, "RESULTS")
    if not records:
        raise click.BadParameter(f"{results!r} holds no results; allowed: a JSON lines file written by `kvtier eval`",
                                 param_hint="'RESULTS'")
    out = check_output_file(out, "--out")
    png = Path(out).with_suffix(".png")
    over = ("the plot" if Path(out).suffix.lower() == ".png" else
            "RESULTS" if Path(results).resolve() in (Path(out).resolve(), png.resolve()) else None)
    if over:
        raise click.BadParameter(f"{out!r} would write over {over} (the markdown goes to --out, the plot to "
                                 f"{png.name} beside it); allowed: a markdown file other than RESULTS, e.g. "
                                 "results.md", param_hint="'--out'")

    from ..eval.report import write_report

    Path(out).absolute().parent.mkdir(parents=True, exist_ok=True)
    png = write_report(records, out, command=f"kvtier report {results}", note=note)
    click.echo(f"wrote {out} and {png}")
