"""The result as a plain-text table (the JSON holds everything; this is what a person reads)."""

from __future__ import annotations

from typing import Any

from .context import ROW_NAMES
from .timing import GiB, MiB


def _fmt(x: float | None, spec: str, unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def _replayed(row: dict[str, Any]) -> str:
    """The pool-attention row's graph-replayed times, one pass / wide / per slab ("-" where none)."""
    got = row.get("replayed_ms") or {}
    return " / ".join(_fmt(v if isinstance(v, float) else None, ".3f")
                      for v in (got.get(k) for k in ("one_pass", "one_pass_wide", "per_slab")))


def _tokens(n: int) -> str:
    return f"{n // 2**20}M" if n % 2**20 == 0 else f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def format_report(result: dict[str, Any]) -> str:
    """The result as a plain-text table."""
    sh, m = result["shape"], result["machine"]
    lines = [f"kvtier bench gpu on {m.get('gpu', m['device'])} ({m['device']}), torch {m['torch']}, transformers "
             f"{m['transformers']}, {m['torch_threads']} CPU thread(s)",
             f"shape {sh['preset']}: {sh['layers']} of {sh['layers_in_shape']} layers"
             f"{' (TRUNCATED)' if sh['truncated'] else ''}, hidden {sh['hidden_size']}, {sh['num_attention_heads']} "
             f"heads, {sh['num_key_value_heads']} KV heads x {sh['head_dim']}, bf16, batch 1, random weights; "
             f"scorer {result.get('scorer', '-')}", ""]
    bw = result["bandwidth"]
    lines.append("bandwidth (GB/s = 1e9 bytes/s)")
    for key in ("raw_copy", "raw_copy_batch"):
        r = bw.get(key, {})
        if r.get("skipped"):
            lines.append(f"  raw copy: skipped ({r['skipped']})")
            continue
        lines.append(f"  raw {'pinned ' if r['pinned'] else ''}copy {r['bytes'] / MiB:,.0f} MiB: host->device "
                     f"{_fmt(r['host_to_device_gbps'], '.1f')}, device->host {_fmt(r['device_to_host_gbps'], '.1f')}")
    tiers, raw = bw.get("tiers", {}), bw.get("raw_copy", {})
    if tiers.get("skipped"):
        lines.append(f"  kvtier batches: skipped ({tiers['skipped']})")
    else:
        for key, label, ref in (("demotion", "demotion (_to_host)", "device_to_host_gbps"),
                                ("demotion_commit", "demotion (commit, end to end)", "device_to_host_gbps"),
                                ("recall", "recall (_bring_up)", "host_to_device_gbps"),
                                ("recall_device", "recall (planned on the device)", "host_to_device_gbps"),
                                ("recall_step", "recall, one step's pages", "host_to_device_gbps")):
            r = tiers.get(key)
            if r is None:
                continue
            if r.get("skipped"):
                lines.append(f"  {label:<32}skipped ({r['skipped']})")
                continue
            share = r["gbps"] / raw[ref] if r.get("gbps") and raw.get(ref) else None
            lines.append(f"  {label:<32}{r['bytes'] / MiB:>9.2f} MiB {_fmt(r['gbps'], '8.2f')}  "
                         f"{_fmt(None if share is None else share * 100, '.0f', '% of raw')}"
                         + (f"  (device {_fmt(r['device_gbps'], '.2f')} GB/s; host issued it in "
                            f"{r['issue_seconds'] * 1e3:.2f} ms of {r['seconds'] * 1e3:.2f})"
                            if r.get("device_gbps") is not None else ""))
    lines += ["  (kvtier batches timed directly through LayerEngine, synchronised; see JSON 'method')", "",
              "decode step, ms (median)"]
    head = f"  {'context':>8}  {'prefill s':>9}  {'kvtier':>9}  {'Dynamic':>9}  {'offload':>9}  " \
           f"{'Dyn/kvtier':>10}  {'off/kvtier':>10}  {'KVP % prefill':>13}"
    lines.append(head)
    skipped = []
    for row in result["decode"]:
        if row.get("skipped"):
            lines.append(f"  {_tokens(row['context']):>8}  skipped: {row['skipped']}")
            continue
        cells = []
        for name in ("kvtier", "dynamic", "offloading"):
            r = row["rows"][name]
            cells.append(_fmt(r.get("step_ms_median"), "9.2f") if not r.get("skipped") else f"{'skipped':>9}")
            if r.get("skipped"):
                skipped.append(f"  {_tokens(row['context'])} {ROW_NAMES[name]}: {r['skipped']}")
        kvp = row.get("kvp_scoring", {})
        frac = None if kvp.get("skipped") else kvp.get("fraction_of_prefill")
        ra = row["ratios"]
        lines.append(f"  {_tokens(row['context']):>8}  {_fmt(row['prefill_seconds'], '9.2f')}  {cells[0]:>9}  "
                     f"{cells[1]:>9}  {cells[2]:>9}  {_fmt(ra['dynamic_over_kvtier'], '9.2f', 'x'):>10}  "
                     f"{_fmt(ra['offloading_over_kvtier'], '9.1f', 'x'):>10}  "
                     f"{_fmt(None if frac is None else frac * 100, '12.2f', '%'):>13}")
    lines += skipped
    for row in result["decode"]:   # how the kvtier row ran, and the rows beside it
        k = row.get("rows", {}).get("kvtier")
        if k is None or k.get("skipped"):
            continue
        ra, counts = row["ratios"], k.get("cuda_graphs_timed", {})
        if ra.get("dynamic_over_kvtier_by_turn") is not None:
            lines.append(f"  {_tokens(row['context'])} DynamicCache and kvtier timed in turn: Dyn/kvtier by turn (median "
                         f"of each turn's ratio) {_fmt(ra['dynamic_over_kvtier_by_turn'], '.2f', 'x')}")
        failed = k.get("cuda_graphs", {}).get("failed")
        if counts.get("replays") or counts.get("captures") or failed:
            lines.append(f"  {_tokens(row['context'])} kvtier's timed steps, CUDA graphs: {counts.get('replays', 0)} "
                         f"replays, {counts.get('captures', 0)} captures, {counts.get('eager_steps', 0)} eager; "
                         f"prefetches on the side stream: {counts.get('prefetch_replays', 0)} replays"
                         + (f"; capture failed: {failed}" if failed else "")
                         + f"; steps that captured first: {k.get('capturing_warmup_ms', [])} ms")
        beside = {   # each row run beside the kvtier one: what it says, given the row
            "kvtier_graph": lambda r: (
                f"kvtier / one graph {_fmt(ra.get('kvtier_over_kvtier_graph'), '.2f', 'x')}, Dyn / one graph "
                f"{_fmt(ra.get('dynamic_over_kvtier_graph'), '.2f', 'x')}, offload / one graph "
                f"{_fmt(ra.get('offloading_over_kvtier_graph'), '.1f', 'x')}; timed steps "
                + ", ".join(f"{v} {k}" for k, v in r.get("decode_graph_timed", {}).items())
                + (f"; capture failed: {r['decode_graph']['failed']}" if r.get("decode_graph", {}).get("failed")
                   else "")
                + _sustained(r.get("sustained"), ra.get("dynamic_over_kvtier_graph_sustained"))),
            "kvtier_eager": lambda r: f"eager / kvtier {_fmt(ra.get('kvtier_eager_over_kvtier'), '.2f', 'x')}",
            "kvtier_side_prefetch": lambda r: (
                f"side stream / in the step's graph {_fmt(ra.get('kvtier_side_prefetch_over_kvtier'), '.2f', 'x')}; "
                f"prefetches replayed there: {r.get('cuda_graphs', {}).get('prefetch', {}).get('replays', 0)}"),
            "kvtier_no_prefetch": lambda r: (
                f"with prefetch / without {_fmt(ra.get('kvtier_over_no_prefetch'), '.2f', 'x')}; chosen pages "
                f"already on the device: {_fmt(r.get('tiers', {}).get('reuse_rate'), '.1%')}"),
            "kvtier_disk": lambda r: (
                f"over the kvtier row {_fmt(ra.get('kvtier_disk_over_kvtier'), '.2f', 'x')}, Dyn / it "
                f"{_fmt(ra.get('dynamic_over_kvtier_disk'), '.2f', 'x')}; {_disk_share(r)}"),
            "kvtier_disk_host_plan": lambda r: (
                f"planned on the host / on the device {_fmt(ra.get('kvtier_disk_host_plan_over_kvtier_disk'), '.2f', 'x')}"
                f"; {_disk_share(r)}")}
        for name, says in beside.items():
            r = row["rows"].get(name)
            if r is not None:
                lines.append(f"  {_tokens(row['context'])} {ROW_NAMES[name]}: " + (
                    f"skipped ({r['skipped']})" if r.get("skipped") else
                    f"{_fmt(r.get('step_ms_median'), '.2f')} ms ({says(r)})"))
    for row in result["decode"]:   # --profile-steps: the first demoting step under cProfile
        dem = row.get("rows", {}).get("kvtier", {}).get("demotion_profile")
        if isinstance(dem, dict) and "step_ms" in dem:
            lines.append(f"  {_tokens(row['context'])} a demoting kvtier step under cProfile: {dem['step_ms']:.1f} ms "
                         f"against {_fmt(dem['other_steps_ms_median'], '.1f')} for the steps before it (JSON "
                         "'demotion_profile')")
    million = result.get("million") or {}
    for row in result["decode"] + [{"context": million.get("context"), "rows": {"million": million}}]:
        # --profile-steps: how busy the device was during a step
        busy = [(ROW_NAMES.get(name, "kvtier"), r["device_profile"]) for name, r in row.get("rows", {}).items()
                if isinstance(r.get("device_profile"), dict) and "device_busy_ms_per_step" in r["device_profile"]]
        if busy:
            lines.append(f"  {_tokens(row['context'])} device busy per step (kernels and copies): " + ", ".join(
                f"{name} {p['device_busy_ms_per_step']:.2f} ms ({p['device_busy_share']:.0%})" for name, p in busy))
        blank = [ROW_NAMES.get(name, "kvtier") for name, r in row.get("rows", {}).items()
                 if isinstance(r.get("device_profile"), dict) and "no_device_activity" in r["device_profile"]]
        if blank:
            lines.append(f"  {_tokens(row['context'])} device profile empty (the profiler recorded no kernel): "
                         + ", ".join(blank))
    issue = [(row["context"], row["rows"][name].get("issue_ms_median"), ROW_NAMES[name])
             for row in result["decode"] if not row.get("skipped")
             for name in ("kvtier", "kvtier_graph", "kvtier_eager", "kvtier_side_prefetch", "kvtier_no_prefetch",
                          "dynamic")
             if name in row["rows"] and not row["rows"][name].get("skipped")]
    if issue:
        lines.append("  host time to issue a step, ms (median; with any wait of the step's own): " +
                     ", ".join(f"{_tokens(c)} {name} {_fmt(ms, '.2f')}" for c, ms, name in issue))
    cost = result.get("launch_cost")
    if cost and cost.get("skipped"):
        lines.append(f"  launch cost: skipped ({cost['skipped']})")
    elif cost:
        lines.append(f"  one launch costs the host {cost['torch_op_us']:.1f} us (a torch op), "
                     f"{cost['native_op_us']:.1f} us (a native op's whole call, {cost['native_path']})"
                     + "".join(f"; {name} launch {us:.1f} us"
                               for name, us in cost.get("native_op_us_by_launcher", {}).items()))
    pool = result.get("pool_attention")
    if pool and pool.get("skipped"):
        lines.append(f"  device pool attention: skipped ({pool['skipped']})")
    elif pool:
        lines.append("  device pool attention, one layer, ms (one pass / wide / per slab; [replayed from a graph]): "
                     + ", ".join(
                         f"{_tokens(r['context'])} {r['one_pass_ms']:.3f} / {_fmt(r.get('one_pass_wide_ms'), '.3f')} "
                         f"/ {r['per_slab_ms']:.3f} [{_replayed(r)}] ({r['slabs']} slabs, {r['one_pass_path']}"
                         + ("" if r.get("wide_same_bits", True) else ", WIDE DIFFERS") + ")"
                         for r in pool["rows"]))
    growth = result.get("growth")
    if growth and growth.get("skipped"):
        lines.append(f"  memory growth run skipped ({growth['skipped']})")
    elif growth:
        lines.append(f"  memory over {growth['steps']} kvtier steps at {_tokens(growth['context'])}: "
                     f"device {growth['device_growth_bytes'] / MiB:+.1f} MiB, "
                     f"host {growth['host_growth_bytes'] / MiB:+.1f} MiB "
                     f"(allowed {growth['allowance']['device_bytes'] / MiB:.1f} / "
                     f"{growth['allowance']['host_bytes'] / MiB:.1f} MiB for {growth['new_tokens']} new tokens)")
        if growth.get("demoting_step_ms_median") is not None and growth.get("other_step_ms_median") is not None:
            lines.append(f"  steps that demote: {growth['demoting_steps']}, median "
                         f"{growth['demoting_step_ms_median']:.2f} ms against {growth['other_step_ms_median']:.2f} ms "
                         "for the others")
    mil = result.get("million")
    if mil is not None:
        lines += ["", f"synthetic {_tokens(mil.get('context', result['settings']['million_context']))}"]
        if mil.get("skipped"):
            lines.append(f"  skipped: {mil['skipped']}")
        else:
            t = mil["tiers"]
            allocated = None if mil["gpu_allocated_bytes"] is None else mil["gpu_allocated_bytes"] / GiB
            lines += [f"  {mil['context']:,} tokens in {mil['layers']} layer(s) ({mil['layers_why']}); fill "
                      f"{mil['fill_seconds']} s; decode step {mil['step_ms_median']:.2f} ms "
                      f"({mil['step_ms_per_layer']:.3f} ms per layer)",
                      f"  GPU: device tier + index {mil['device_tier_plus_index_bytes'] / GiB:.2f} GiB "
                      f"(cache pools; recall buffers {mil.get('recall_buffer_bytes', 0) / GiB:.2f} GiB), "
                      f"allocated {_fmt(allocated, '.2f', ' GiB')}; projected to {sh['layers_in_shape']} layers: "
                      f"{mil['projected_gpu_bytes_full_shape'] / GiB:.2f} GiB",
                      f"  tiers: device {t['device']['bytes'] / GiB:.2f} GiB ({t['device']['tokens']:,} entries), "
                      f"host {t['host']['bytes'] / GiB:.2f} GiB, disk {t['disk']['bytes'] / GiB:.2f} GiB"]
            whole = mil.get("decode_graph")
            if whole and whole.get("skipped"):
                lines.append(f"  stepped by DecodeGraph: skipped ({whole['skipped']})")
            elif whole:
                lines.append(f"  stepped by DecodeGraph (one graph a step): {whole['step_ms_median']:.2f} ms "
                             f"({whole['step_ms_per_layer']:.3f} ms per layer); timed steps "
                             + ", ".join(f"{v} {k}" for k, v in whole["decode_graph_timed"].items())
                             + (f"; capture failed: {whole['decode_graph']['failed']}"
                                if whole["decode_graph"].get("failed") else ""))
    lines += ["", f"targets ({result.get('targets_note', '')})"]
    for t in result["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["pass"]]
        lines.append(f"  {verdict:<5}{t['name']:<28}{_fmt(t['measured'], '.3g'):>8} {t['unit']:<9}"
                     f"(limit {t['threshold']:.3g})  {t['note']}"
                     + (f" [stepped by DecodeGraph: {t['with_decode_graph']:.3g} {t['unit']}"
                        + (f"; {t['with_decode_graph_sustained']:.3g} {t['unit']} over a long decode"
                           if t.get("with_decode_graph_sustained") is not None else "") + "]"
                        if t.get("with_decode_graph") is not None else ""))
    secs = result["seconds"]
    started = f" ({secs['process']:.1f} s with start-up)" if "process" in secs else ""
    lines.append(f"\ntotal {secs['total']:.1f} s{started}")
    return "\n".join(lines)


def _disk_share(row: dict[str, Any]) -> str:
    """What a disk row's cache held on disk and brought up from there over its run."""
    tiers = row.get("tiers", {})
    came = tiers.get("pages_recalled_from", {})
    return (f"{tiers.get('disk', {}).get('tokens', 0):,} tokens on disk; pages recalled from disk "
            f"{came.get('disk', 0):,} of {came.get('disk', 0) + came.get('host', 0):,}")


def _sustained(run: dict[str, Any] | None, ratio: float | None) -> str:
    """The sustained run of the one-graph row, as a clause: its mean step (demotions and captures included)."""
    if run and run.get("skipped"):
        return f"; sustained run skipped ({run['skipped']})"
    if not run or not run.get("steps"):
        return ""
    counts = run.get("decode_graph", {})
    return (f"; over {run['steps']} steps (demotions and captures included): mean {_fmt(run['step_ms_mean'], '.2f')} "
            f"ms, Dyn / it {_fmt(ratio, '.2f', 'x')}, {run['demoting_steps']} demoting "
            f"({_fmt(run.get('demoting_step_ms_median'), '.1f')} ms median), {counts.get('captures', 0)} captures, "
            f"{counts.get('eager', 0)} eager, {counts.get('ordinary', 0)} ordinary")
