"""The issue's targets, each with its measured value and pass/fail (None, with the reason, when a row did
not run); they are set for an H200.
"""

from __future__ import annotations

from typing import Any

from .context import ROW_NAMES
from .timing import GiB, MiB, _r

TARGET_CONTEXT = 131072            # the decode targets are at 128K
GROWTH_STEPS = 1000                # and memory growth is judged over this many decode steps


def _target(name: str, description: str, measured: float | None, unit: str, threshold: float, better: str,
            note: str = "", **extra: Any) -> dict[str, Any]:
    ok = None if measured is None else (measured >= threshold if better == "higher" else measured <= threshold)
    return {"name": name, "target": description, "measured": _r(measured, 4), "unit": unit,
            "threshold": threshold, "pass": ok, "note": note or ("not measured" if measured is None else ""), **extra}


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue with its measured value and pass/fail (None: not measured, with why)."""
    out = []
    bw = result.get("bandwidth", {})
    raw, tiers = bw.get("raw_copy", {}), bw.get("tiers", {})
    # recall is judged on the slower of its two paths: planned on the host (`_bring_up`, the CPU's path) and on
    # the device (a decode step's own on CUDA; its disk pages follow into the slots the plan gave them)
    for name, moves, direction in (("demotion_vs_raw_copy", ("demotion",), "device_to_host_gbps"),
                                   ("recall_vs_raw_copy", ("recall", "recall_device"), "host_to_device_gbps")):
        each = {m: (tiers.get(m) or {}).get("gbps") for m in moves if m in tiers}
        got, base = min((g for g in each.values() if g), default=None), raw.get(direction)
        what = " and ".join(moves).replace("_", " ")
        extra = {"by_path": {m: _r(g / base, 4) if g and base else None for m, g in each.items()}} \
            if len(moves) > 1 else {}
        missing = [m for m in moves if not each.get(m)]
        note = (f"not measured ({tiers.get('skipped') or raw.get('skipped')})" if not (got and base) else
                f"judged without {', '.join(missing)} (not measured: "
                f"{'; '.join(str((tiers.get(m) or {}).get('skipped')) for m in missing)})" if missing else "")
        out.append(_target(name, f"{what} batch >= 90% of the raw pinned copy ({direction[:-5].replace('_', ' ')})",
                           got / base if got and base else None, "fraction", 0.9, "higher", note, **extra))
    decode = result.get("decode", [])
    rows = [r for r in decode if "rows" in r]
    # a 128K context that was asked for and failed gives no verdict: a smaller context stands in only for one
    # never asked for
    lost = next((f"the {TARGET_CONTEXT:,}-token context did not run ({r.get('skipped', 'no rows')})"
                 for r in decode if r.get("context") == TARGET_CONTEXT and "rows" not in r), "")
    ref = None if lost else next((r for r in rows if r["context"] == TARGET_CONTEXT), rows[-1] if rows else None)
    note = "" if ref is None or ref["context"] == TARGET_CONTEXT else \
        f"measured at {ref['context']:,} tokens, the largest context of this run (the target is at 128K)"
    ctx = None if ref is None else ref["context"]
    ratios = {} if ref is None else ref["ratios"]
    # judged on the kvtier row (the cache as made by default); the same ratio stepped by DecodeGraph beside it
    out.append(_target("decode_vs_dynamic_gpu", "decode step no slower than DynamicCache all on the GPU "
                       "(DynamicCache step / kvtier step >= 1)", ratios.get("dynamic_over_kvtier"), "x", 1.0,
                       "higher", note if ratios.get("dynamic_over_kvtier") else _why(ref, "dynamic", lost),
                       context=ctx,
                       with_decode_graph=ratios.get("dynamic_over_kvtier_graph"),
                       with_decode_graph_sustained=ratios.get("dynamic_over_kvtier_graph_sustained")))
    out.append(_target("decode_vs_offloading", ">= 15x faster than DynamicCache(offloading=True)",
                       ratios.get("offloading_over_kvtier"), "x", 15.0, "higher",
                       note if ratios.get("offloading_over_kvtier") else _why(ref, "offloading", lost), context=ctx,
                       with_decode_graph=ratios.get("offloading_over_kvtier_graph")))
    mil = result.get("million") or {}
    if mil.get("skipped") or not mil:
        why = mil.get("skipped", "the 1M row was not run (--no-million)")
        out.append(_target("million_gpu_bytes", "1M: device tier + index <= 24 GiB", None, "GiB", 24.0, "lower", why))
        out.append(_target("million_decode_vs_dynamic", "1M: decode step <= 2x the 128K all-on-GPU step", None, "x",
                           2.0, "lower", why))
    else:
        at = "" if mil["context"] == 2**20 else f"measured at {mil['context']:,} tokens (the target is at 1M); "
        out.append(_target("million_gpu_bytes", "1M: device tier + index <= 24 GiB (all layers of the shape)",
                           mil["projected_gpu_bytes_full_shape"] / GiB, "GiB", 24.0, "lower",
                           at + mil["projection"], context=mil["context"]))
        base = None if ref is None else ref["rows"].get("dynamic", {}).get("step_ms_median")
        per_layer_base = None if not base else base / result["shape"]["layers"]
        ratio = None if not base else mil["step_ms_per_layer"] / per_layer_base
        graph = (mil.get("decode_graph") or {}).get("step_ms_per_layer")
        why = _why(ref, "dynamic", lost)
        out.append(_target("million_decode_vs_dynamic", "1M: decode step <= 2x the 128K all-on-GPU step", ratio, "x",
                           2.0, "lower", (at + "per layer: the 1M step over its layers vs the DynamicCache step "
                                          "over the run's layers (conservative: fixed per-step costs weigh more on "
                                          "fewer layers)" + (f"; {note}" if note else "")) if ratio else why,
                           context=mil["context"],
                           with_decode_graph=_r(graph / per_layer_base, 4) if graph and per_layer_base else None))
    growth = result.get("growth")
    for side in ("device", "host"):
        g = growth or {}
        measured = g.get(f"{side}_growth_bytes")
        limit = g.get("allowance", {}).get(f"{side}_bytes", 0)
        note = ("growth run did not happen" if growth is None else
                f"growth run skipped: {growth['skipped']}" if growth.get("skipped") else
                f"{g['steps']} of {g['steps_asked']} steps (stopped at "
                f"--{(g.get('stopped_by') or 'growth_seconds').replace('_', '-')})" if g["stopped_early"] else
                f"{g['steps']} steps (the target's: {GROWTH_STEPS:,}), {g['new_tokens']} new tokens")
        short = growth is not None and not growth.get("skipped") and g["steps"] < GROWTH_STEPS
        t = _target(f"no_{side}_memory_growth",
                    f"no growth of {'GPU' if side == 'device' else 'pinned host'} memory over {GROWTH_STEPS:,} "
                    "decode steps (beyond the new tokens' K/V and one allocation unit per pool)",
                    None if measured is None else measured / MiB, "MiB", limit / MiB, "lower", note)
        if short and t["pass"]:
            t["pass"] = None   # fewer steps than the target asks: no verdict (a failure over fewer still fails)
        out.append(t)
    seconds = result.get("seconds", {})
    total = seconds.get("process", seconds.get("total"))   # start-up included where the run measured it
    out.append(_target("under_5_minutes", "the whole command under 5 minutes (on an H200)", total, "s", 300.0,
                       "lower", "" if result.get("device", "").startswith("cuda") else "timed on cpu"))
    return out


def _why(ref: dict[str, Any] | None, row: str, lost: str = "") -> str:
    if ref is None:
        return lost or "no context was run"
    for name in ("kvtier", row):
        if ref["rows"].get(name, {}).get("skipped"):
            return f"{ROW_NAMES[name]}: {ref['rows'][name]['skipped']}"
    return "not measured"
