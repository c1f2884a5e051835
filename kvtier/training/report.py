"""Write the scorer evaluation as a markdown table and a PNG plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_scorer_report(result: dict[str, Any], markdown: str | Path, command: str) -> Path:
    """Markdown table (mean kept mass per scorer and budget) plus ``<name>.png`` with two panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markdown = Path(markdown)
    png = markdown.with_suffix(".png")
    budgets = result["budgets"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, row in result["mean"].items():
        style = "-" if name == "kvp" else ("--" if name in ("tova", "snapkv", "h2o") else ":")
        ax1.plot([b * 100 for b in budgets], [row[str(b)] for b in budgets], style, marker="o", label=name,
                 linewidth=2.5 if name == "kvp" else 1.2)
        mid = str(budgets[len(budgets) // 2])
        ax2.plot(result["per_layer"][name][mid], style, label=name, linewidth=2.5 if name == "kvp" else 1.0)
    ax1.set(xlabel="device budget (% of prompt tokens)", ylabel="future attention mass kept",
            title="mean over held-out traces, layers, heads")
    ax2.set(xlabel="layer", ylabel="mass kept", title=f"per layer at {float(mid):.0%}")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    lines = ["| scorer | " + " | ".join(f"{b:.0%}" for b in budgets) + " |",
             "| --- | " + " | ".join("---" for _ in budgets) + " |"]
    for name, row in result["mean"].items():
        best = {str(b): max(r[str(b)] for r in result["mean"].values()) for b in budgets}
        cells = [f"**{row[str(b)]:.3f}**" if row[str(b)] == best[str(b)] else f"{row[str(b)]:.3f}" for b in budgets]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = (f"Produced by `{command}` on {result['traces']} held-out traces.\n\n" + "\n".join(lines)
            + f"\n\n![kept mass]({png.name})\n")
    markdown.write_text(text)
    return png
