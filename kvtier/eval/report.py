"""Turn result lines into markdown tables and plots (behind `kvtier report`)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

from ..scoring import BASELINES_ATTENTION_BASED, BASELINES_ATTENTION_FREE
from .policies import RECALL_PAGES


def _value(r: dict[str, Any]) -> float:
    """A result's number: its perplexity, or its score x 100."""
    return r["ppl"] if r.get("ppl") is not None else 100 * r["score"]


def example_key(r: dict[str, Any]) -> tuple[str, int, int]:
    return r["task"], r["length"], r["seed"]


def latest(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run (example, policy, budget) once, its last row: a row made again (its prompt had changed since, say)
    stands for the run, in the place of the first."""
    last = {(*example_key(r), r["policy"], r["budget"]): r for r in results}
    return list(last.values())


def same_prompt(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two rows of one example ran the same prompt: the same tokens (``prompt_sha``), or, for rows written
    before rows named their prompt, as many tokens."""
    if a.get("prompt_sha") and b.get("prompt_sha"):
        return a["prompt_sha"] == b["prompt_sha"]
    return a.get("prompt_tokens") == b.get("prompt_tokens")


def full_by_example(results: list[dict[str, Any]]) -> dict[tuple[str, int, int], dict[str, Any]]:
    """The full cache's result for each example (task, length, seed): what every policy is compared with."""
    return {example_key(r): r for r in results if r["policy"] == "full"}


def matched(results: list[dict[str, Any]], task: str, policy: str, budget: float) -> list[tuple[dict, dict]]:
    """``(row, the full cache's row)`` for each example of `task` that both ran on the same prompt: comparisons
    against the full cache are made over the same examples (a policy's mean over other examples compares unlike
    sets, and a row of an older prompt is another example)."""
    full_of = full_by_example(results)
    return [(r, full_of[example_key(r)]) for r in results
            if r["task"] == task and r["policy"] == policy and r["budget"] == budget and example_key(r) in full_of
            and same_prompt(r, full_of[example_key(r)])]


def budget_label(budget: float) -> str:
    """A budget as a column's label: every digit kept (0.12 and 0.125 are two columns, not two "12%")."""
    return f"{100 * budget:g}%"


def _unlike_full(results: list[dict[str, Any]]) -> set[tuple[str, str, float]]:
    """(task, policy, budget) whose examples are not the full cache's (fewer, other ones, or other prompts), for a
    task the full cache ran: their means are marked in the tables, as they compare unlike sets."""
    full_of = full_by_example(results)
    ran: dict[tuple, set] = defaultdict(set)
    for r in results:
        if r["policy"] != "full":
            ran[(r["task"], r["policy"], r["budget"])].add(
                example_key(r) if example_key(r) in full_of and same_prompt(r, full_of[example_key(r)]) else None)
    full_sets: dict[str, set] = defaultdict(set)
    for key in full_of:
        full_sets[key[0]].add(key)
    return {k for k, examples in ran.items() if full_sets[k[0]] and examples != full_sets[k[0]]}


def summary_budget(results: list[dict[str, Any]], wanted: float = 0.1) -> float:
    """The budget the summary is made at: `wanted` where it was run, else the run budget nearest to it."""
    budgets = sorted({r["budget"] for r in results if r["policy"] != "full"})
    return min(budgets, key=lambda b: (abs(b - wanted), b)) if budgets else wanted


def _task_order(table: dict[str, Any]) -> list[str]:
    return sorted(table, key=lambda t: (t == "perplexity", t))


def aggregate(results: list[dict[str, Any]]) -> dict[str, dict[str, dict[float, float]]]:
    """task -> policy -> budget -> mean score x 100 (accuracy) or mean perplexity."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    for r in results:
        groups[(r["task"], r["policy"], r["budget"])].append(_value(r))
    table: dict[str, dict[str, dict[float, float]]] = defaultdict(lambda: defaultdict(dict))
    for (task, policy, budget), values in groups.items():
        table[task][policy][budget] = mean(values)
    return table


def _best(row_of: dict[str, dict[float, float]], names: list[str], budget: float, lower: bool) -> tuple[str, float]:
    found = [(row_of[n][budget], n) for n in names if budget in row_of.get(n, {})]
    if not found:
        return "-", float("nan")
    value, name = min(found) if lower else max(found)
    return name, value


def summary_lines(results: list[dict[str, Any]], budget: float = 0.1, scorer: str = "kvp") -> list[str]:
    """The comparison the suite exists for, at one budget: full vs tier vs eviction, and the targets. A mean over
    other examples than the full cache's is marked ``*``."""
    results = latest(results)
    table = aggregate(results)
    unlike = _unlike_full(results)
    tasks = _task_order(table)
    generation = [t for t in tasks if t != "perplexity"]
    tier, evict = f"tier:{scorer}", f"evict:{scorer}"
    free = [f"evict:{s}" for s in BASELINES_ATTENTION_FREE]
    based = [f"evict:{s}" for s in BASELINES_ATTENTION_BASED]
    present = {r["policy"] for r in results}

    def cell(value: float, ppl: bool) -> str:
        if math.isnan(value):   # not run (no full cache asked for, say)
            return "-"
        return f"{value:.2f}" if ppl else f"{value:.1f}"

    def mark(task: str, name: str) -> str:
        return "*" if (task, name, budget) in unlike else ""

    def best_of(group: list[str]):
        def fn(task: str, rows: dict, ppl: bool) -> str:
            name, value = _best(rows, group, budget, lower=ppl)
            return f"{cell(value, ppl)}{mark(task, name)} ({name.partition(':')[2]})"
        return fn

    def policy(name: str):
        return lambda task, rows, ppl: cell(rows.get(name, {}).get(budget, float("nan")), ppl) + mark(task, name)

    columns = [(title, fn) for title, fn, shown in (
        (tier, policy(tier), tier in present), (evict, policy(evict), evict in present),
        ("best other attention-free evict", best_of(free), bool(present.intersection(free))),
        ("best attention-based evict", best_of(based), bool(present.intersection(based)))) if shown]
    out = [f"## Summary at {budget_label(budget)} of the cache on the device\n",
           "| task | full | " + " | ".join(title for title, _ in columns) + " |",
           "| --- | --- | " + " | ".join("---" for _ in columns) + " |"]
    for task in tasks:
        ppl = task == "perplexity"
        rows = table[task]
        full = rows.get("full", {}).get(1.0, float("nan"))
        out.append(f"| {task} | {cell(full, ppl)} | " + " | ".join(fn(task, rows, ppl) for _, fn in columns) + " |")
    budgets = sorted({r["budget"] for r in results if r["policy"] != "full"})
    policies = sorted({r["policy"] for r in results}, key=lambda p: (p != "full", not p.startswith("tier"), p))
    means = {p: {b: mean(table[t][p][b] for t in generation) for b in budgets + [1.0]
                 if generation and all(b in table[t].get(p, {}) for t in generation)} for p in policies}
    if generation:   # a perplexity-only run has no accuracy to average
        shown = budgets or [1.0]   # a run of the full cache alone: its one column
        out += ["", f"Mean accuracy over the {len(generation)} generation tasks:\n",
                "| policy | " + " | ".join("full" if not budgets else budget_label(b) for b in shown) + " |",
                "| --- | " + " | ".join("---" for _ in shown) + " |"]
        for p in policies:
            vals = [(means[p].get(1.0 if p == "full" else b),
                     "*" if any((t, p, b) in unlike for t in generation) else "") for b in shown]
            out.append(f"| {p} | " + " | ".join("" if v is None else f"{v:.1f}{m}" for v, m in vals) + " |")
    if unlike:
        out += ["", "\\* a mean over other examples than the full cache's (fewer, or run on other prompts): it "
                "compares unlike sets; the checks below compare example by example."]
    out.append("")
    checks = []
    gaps = [(abs(d), d, t) for t in generation if (pairs := matched(results, t, tier, budget))
            for d in [mean(_value(r) - _value(f) for r, f in pairs)]]
    if gaps:
        _, gap, where = max(gaps)
        checks.append(f"- {tier} at {budget_label(budget)}: the largest departure from the full cache over the "
                      f"generation tasks is {gap:+.1f} points ({where}; over the examples both ran).")
    cells = [(r, f) for t in generation for r, f in matched(results, t, tier, budget) if r.get("score") is not None]
    if cells:
        below = sum(r["score"] < f["score"] for r, f in cells)
        above = sum(r["score"] > f["score"] for r, f in cells)
        same = sum(r["output"] == f["output"] for r, f in cells)
        checks.append(f"- {tier} at {budget_label(budget)}, example by example: below the full cache's score on "
                      f"{below} of {len(cells)}, above on {above}; the very same answer text on {same}.")
    pairs = matched(results, "perplexity", tier, budget)
    if pairs:
        lengths = sorted({r["length"] for r, _ in pairs})
        per = [f"{100 * (mean(r['ppl'] for r, _ in at) / mean(f['ppl'] for _, f in at) - 1):+.2f}% at {n}"
               for n in lengths for at in [[(r, f) for r, f in pairs if r["length"] == n]]]
        ratio = mean(r["ppl"] for r, _ in pairs) / mean(f["ppl"] for _, f in pairs)
        checks.append(f"- {tier} at {budget_label(budget)}: perplexity {100 * (ratio - 1):+.2f}% against the full "
                      f"cache (mean over the {len(pairs)} examples both ran; {', '.join(per)}).")
    ranked = sorted(((means[p][budget], p) for p in [evict, *free] if budget in means.get(p, {})), reverse=True)
    if ranked:
        checks.append(f"- Evict mode at {budget_label(budget)}, attention-free scorers by mean accuracy: "
                      + ", ".join(f"{p.partition(':')[2]} {v:.1f}" for v, p in ranked) + ".")
    return out + checks + [""]


def write_report(results: list[dict[str, Any]], markdown: str | Path, command: str, note: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markdown = Path(markdown)
    png = markdown.with_suffix(".png")
    results = latest(results)
    table = aggregate(results)
    unlike = _unlike_full(results)
    budgets = sorted({r["budget"] for r in results if r["policy"] != "full"})
    tasks = _task_order(table)
    lengths = sorted({r["length"] for r in results})
    seeds = sorted({r["seed"] for r in results})
    lines = ["# Results: tiering with recall vs eviction\n",
             f"Produced by `{command}`: {len(results)} runs, prompt lengths {', '.join(map(str, lengths))} tokens, "
             f"seeds {', '.join(map(str, seeds))}. Accuracy is RULER's string match x 100 (mean over lengths and "
             "seeds); perplexity is over 256 held-out tokens after the compressed context (lower is better). "
             "`full` is the uncompressed cache; `tier` keeps the budget on the device and recalls up to "
             f"{RECALL_PAGES} pages of 16 tokens per layer and KV head at each step; `evict` drops the rest. "
             "One example per task, length and seed: an accuracy cell moves in large steps, so read trends.\n"]
    if note:
        lines.append(note + "\n")
    lines += summary_lines(results, summary_budget(results))
    lines.append("## All tables\n")
    for task in tasks:
        lines.append(f"### {task}\n")
        shown = budgets or [1.0]   # a run of the full cache alone: its one column
        lines.append("| policy | " + " | ".join("full" if not budgets else budget_label(b) for b in shown) + " |")
        lines.append("| --- | " + " | ".join("---" for _ in shown) + " |")
        for policy, row in sorted(table[task].items(), key=lambda kv: (kv[0] != "full", kv[0])):
            cells = [f"{row.get(1.0, float('nan')):.1f}"] * len(shown) if policy == "full" else \
                [(f"{row[b]:.2f}" if task == "perplexity" else f"{row[b]:.1f}") +
                 ("*" if (task, policy, b) in unlike else "") if b in row else "" for b in shown]
            if policy == "full" and task == "perplexity":
                cells = [f"{row[1.0]:.3f}"] * len(shown)
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
        lines.append("")
    cols = 3
    rows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for policy, row in sorted(table[task].items()):
            if policy == "full":
                ax.axhline(row[1.0], color="black", linestyle="--", linewidth=1, label="full")
                continue
            xs = [b for b in budgets if b in row]
            ax.plot([100 * b for b in xs], [row[b] for b in xs], marker="o", label=policy,
                    linewidth=2.2 if policy.startswith("tier") else 1.0)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("device budget (%)", fontsize=8)
        ax.set_ylabel("perplexity" if task == "perplexity" else "accuracy", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    lines.append(f"![accuracy vs budget]({png.name})\n")
    markdown.write_text("\n".join(lines))
    return png
