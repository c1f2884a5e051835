"""Turn result lines into markdown tables and plots (behind `kvtier report`)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any


def aggregate(results: list[dict[str, Any]]) -> dict[str, dict[str, dict[float, float]]]:
    """task -> policy -> budget -> mean score x 100 (accuracy) or mean perplexity."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    for r in results:
        value = r["ppl"] if r.get("ppl") is not None else 100 * r["score"]
        groups[(r["task"], r["policy"], r["budget"])].append(value)
    table: dict[str, dict[str, dict[float, float]]] = defaultdict(lambda: defaultdict(dict))
    for (task, policy, budget), values in groups.items():
        table[task][policy][budget] = mean(values)
    return table


def write_report(results: list[dict[str, Any]], markdown: str | Path, command: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markdown = Path(markdown)
    png = markdown.with_suffix(".png")
    table = aggregate(results)
    budgets = sorted({r["budget"] for r in results if r["policy"] != "full"})
    tasks = sorted(table, key=lambda t: (t == "perplexity", t))
    lengths = sorted({r["length"] for r in results})
    lines = [f"Produced by `{command}`: {len(results)} runs, prompt lengths {', '.join(map(str, lengths))} tokens. "
             "Accuracy is RULER's string match x 100 (mean over lengths and seeds); perplexity is over 256 held-out "
             "tokens after the compressed context (lower is better). `full` is the uncompressed cache; `tier` "
             "keeps the budget on the device and recalls 32 pages per layer and head; `evict` drops the rest.\n"]
    for task in tasks:
        lines.append(f"### {task}\n")
        lines.append("| policy | " + " | ".join(f"{b:.0%}" for b in budgets) + " |")
        lines.append("| --- | " + " | ".join("---" for _ in budgets) + " |")
        for policy, row in sorted(table[task].items(), key=lambda kv: (kv[0] != "full", kv[0])):
            cells = [f"{row.get(1.0, float('nan')):.1f}"] * len(budgets) if policy == "full" else \
                [f"{row[b]:.2f}" if task == "perplexity" and b in row else (f"{row[b]:.1f}" if b in row else "")
                 for b in budgets]
            if policy == "full" and task == "perplexity":
                cells = [f"{row[1.0]:.3f}"] * len(budgets)
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
