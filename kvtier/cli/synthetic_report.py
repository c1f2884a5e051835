"""Output of `kvtier demo --synthetic`."""

from __future__ import annotations

import json

import click

from .format import human_bytes


def run_synthetic(arch: str, tokens: int, needles: int, device_budget, host_budget, recall_pages: int,
                  as_json: bool, disk_dir: str | None = None, device: str = "cpu", scorer: str = "keynorm") -> None:
    """Fill one synthetic layer (its disk tier in a private folder inside `disk_dir`) and print what recall found."""
    import os

    from tqdm import tqdm

    from ..bench.synthetic import synthetic_needles

    if disk_dir is not None:
        disk_dir = os.path.expanduser(disk_dir)
        os.makedirs(disk_dir, exist_ok=True)
    report = synthetic_needles(arch, tokens, needles, device_budget, host_budget, recall_pages, disk_dir=disk_dir,
                               progress=lambda it: tqdm(it, desc="filling", disable=as_json), device=device,
                               scorer=scorer)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"\nSYNTHETIC: {tokens:,} tokens of Gaussian KV in one layer shaped like {arch} "
               f"({report['layers_in_arch']} layers in the real model), {needles} planted needles; no model ran; "
               f"entries ranked by {report['settings']['scorer']}; device tier on {report['settings']['device']}")
    for n in report["needles"]:
        click.echo(f"  needle at {n['position']:>9,}: {'recalled' if n['recalled'] else 'MISSED':<8} "
                   f"output vs needle value cos {n['cosine_to_needle_value']:.4f}, "
                   f"max |diff| vs exact attention over every key {n['max_abs_error_vs_full']:.1e}; "
                   f"decode step (recall + attention) {n['tiered_step_seconds'] * 1e3:.0f} ms")
    u = report["usage"]
    total = sum(u[t]["tokens"] for t in ("device", "host", "disk"))
    for t in ("device", "host", "disk"):
        click.echo(f"  {t:<7}{u[t]['tokens'] / max(total, 1):>7.1%} of entries  {human_bytes(u[t]['bytes']):>10}")
    moved = ", ".join(f"{k.replace('_', ' ')} {human_bytes(v)}" for k, v in report["bytes_moved"].items())
    click.echo(f"  moved: {moved}; filled in {report['fill_seconds']:.0f} s")
