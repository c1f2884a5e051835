"""Small helpers for human-readable command output."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def tier_lines(stats: dict) -> list[str]:
    """Tokens and bytes per tier, and what moved, from `TieredCache.stats()`."""
    per = max(stats["layers"] * stats["kv_heads"], 1)   # a model of sliding-window layers only tiers none
    lines = []
    for tier in ("device", "host", "disk"):
        t = stats[tier]
        share = t["tokens"] / max(stats["tokens_seen"] * per, 1)
        lines.append(f"  {tier:<7}{t['tokens'] // per:>9,} tokens/head  {share:>6.1%}  {human_bytes(t['bytes']):>10}")
    moved = ", ".join(f"{k.replace('_', ' ')} {human_bytes(v)}" for k, v in stats["bytes_moved"].items())
    lines.append(f"  moved: {moved}")
    lines.append(f"  recalled: {stats['pages_recalled']:,} pages ({stats['pages_recalled_from']['host']:,} from host, "
                 f"{stats['pages_recalled_from']['disk']:,} from disk) over {stats['recall_steps']:,} layer-steps; "
                 f"waited {stats['transfer_wait_seconds']:.2f} s on copies and reads")
    return lines
