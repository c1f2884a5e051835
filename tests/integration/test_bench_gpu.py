"""`kvtier bench gpu` end to end on the CPU at tiny sizes (same code as on the GPU), through click's runner:
the JSON's structure, the ratios and the targets, rows skipped with a reason, and mistakes in the options."""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch
from click.testing import CliRunner

from kvtier.bench.gpu import TARGET_CONTEXT, evaluate_targets
from kvtier.cli import main
from kvtier.native import kernel_status as kvtier_native_status

TINY = ["bench", "gpu", "--shape", "tiny", "--layers", "2", "--contexts", "1K,2K", "--million-context", "8K",
        "--steps", "2", "--warmup", "1", "--growth-steps", "24", "--sustained-steps", "20", "--copy-mib", "8",
        "--batch-mib", "1", "--prefill-chunk", "512", "--threads", "1", "--profile-steps", "1", "--time-limit", "0"]
TARGETS = {"demotion_vs_raw_copy", "recall_vs_raw_copy", "decode_vs_dynamic_gpu", "decode_vs_offloading",
           "million_gpu_bytes", "million_decode_vs_dynamic", "no_device_memory_growth", "no_host_memory_growth",
           "under_5_minutes"}


def run(*args):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "gpu.json"
    result = run(*TINY, "--device", "cpu", "--out", str(out))
    assert result.exit_code == 0, result.output
    return result.output, json.loads(out.read_text())


def test_table_and_json_are_written(cpu_run):
    text, data = cpu_run
    assert "decode step, ms" in text and "targets" in text and "TRUNCATED" in text
    assert data["device"] == "cpu" and data["machine"]["torch_threads"] == 1
    assert data["shape"] == {**data["shape"], "preset": "tiny", "layers": 2, "layers_in_shape": 4, "truncated": True,
                             "dtype": "bfloat16", "batch": 1, "weights": "random"}
    assert set(data["seconds"]) >= {"bandwidth", "model_init", "context_1024", "context_2048", "million", "total"}
    assert "process" not in data["seconds"]   # run inside pytest, not as a command of its own: no start-up to add
    assert "untrained" in data["scorer"]
    # what one launch costs the host, and how long each step took to issue: whether steps are host-bound
    cost = data["launch_cost"]
    assert cost["torch_op_us"] > 0 and cost["native_op_us"] > 0 and cost["native_path"] == "twin"
    assert "one launch costs the host" in text and "host time to issue a step" in text


def test_profiles_say_where_a_steps_time_goes(cpu_run):
    """--profile-steps: the kvtier and DynamicCache rows carry the Python functions that took the host's time
    (package-relative names, no machine's paths) and, on a GPU only, the device's kernels."""
    _, data = cpu_run
    for r in data["decode"]:
        for name in ("kvtier", "dynamic"):
            host = r["rows"][name]["host_profile"]
            assert host["steps"] == 1 and len(host["step_ms_profiled"]) == 1
            names = [f["function"] for f in host["by_cumulative_time"]]
            assert any(n.startswith("kvtier/") for n in names) if name == "kvtier" else names
            assert not any(n.startswith("/") for n in names), names
            assert all(f["own_ms_per_step"] >= 0 and f["calls_per_step"] > 0 for f in host["by_own_time"])
            assert r["rows"][name]["device_profile"] == {"skipped": "no device kernels on cpu"}
    assert data["million"]["host_profile"]["steps"] == 1 and "skipped" in data["million"]["device_profile"]
    demoting = data["decode"][0]["rows"]["kvtier"]["demotion_profile"]   # the first context's: a demoting step
    assert demoting["steps_until_one_demoted"] >= 1 and demoting["step_ms"] > 0, demoting
    assert any(f["function"].startswith("kvtier/") for f in demoting["by_cumulative_time"])
    assert "demotion_profile" not in data["decode"][1]["rows"]["kvtier"]


def test_pool_attention_rows(cpu_run):
    """The device pool's attention both ways at every context's pool (the 1M row's too), the same attention."""
    text, data = cpu_run
    pool = data["pool_attention"]
    assert [r["context"] for r in pool["rows"]] == [1024, 2048, 8192]
    for r in pool["rows"]:
        assert abs(r["entries"] - 0.1 * r["context"]) <= 2 and r["slabs"] == 1
        assert r["one_pass_ms"] > 0 and r["per_slab_ms"] > 0 and r["one_pass_path"] == "twin"
        assert r["one_pass_wide_ms"] > 0 and r["wide_same_bits"]
        assert r["replayed_ms"]["one_pass"].startswith("no graph")   # no graphs on a CPU: said so
        assert r["max_abs_diff"] < 1e-2   # the attention calls of the per-slab path give bf16 outputs
    assert "device pool attention, one layer" in text and "pool_attention" in data["seconds"]


def test_bandwidth_rows(cpu_run):
    bw = cpu_run[1]["bandwidth"]
    assert "LayerEngine._to_host" in bw["method"] and "_bring_up" in bw["method"]
    assert bw["raw_copy"]["bytes"] == 8 * 2**20 and bw["raw_copy"]["pinned"] is False
    assert bw["raw_copy"]["host_to_device_gbps"] > 0
    for key in ("demotion", "demotion_commit", "recall", "recall_step", "recall_device"):
        row = bw["tiers"][key]
        assert row["bytes"] > 0 and row["gbps"] > 0, key
    for key in ("demotion", "recall", "recall_step", "recall_device"):   # the host's share apart; no device clock
        row = bw["tiers"][key]                                           # on a CPU
        assert 0 < row["issue_seconds"] <= row["seconds"] and row["device_seconds"] is None, row
    # one step's recall: recall_pages (64) pages for each of the 2 KV heads
    assert bw["tiers"]["recall_step"]["pages"] == 128
    # a decode step's own recall (planned on the device) at the batch size, as many pages as the host-planned one
    assert bw["tiers"]["recall_device"]["pages"] == bw["tiers"]["recall"]["pages"]
    # recall's target is judged on the slower of its two paths
    recall = next(t for t in cpu_run[1]["targets"] if t["name"] == "recall_vs_raw_copy")
    by = recall["by_path"]
    assert set(by) == {"recall", "recall_device"} and recall["measured"] == pytest.approx(min(by.values()), rel=1e-3)


def test_recall_judged_on_the_path_measured_when_the_other_failed(cpu_run):
    """A failed device-planned recall is a skipped row of its own: the other batches stand, and the recall target
    says it was judged without it."""
    import copy

    from kvtier.bench.gpu.report import format_report

    data = copy.deepcopy(cpu_run[1])
    data["bandwidth"]["tiers"]["recall_device"] = {"skipped": "RuntimeError: injected"}
    data["targets"] = evaluate_targets(data)
    recall = next(t for t in data["targets"] if t["name"] == "recall_vs_raw_copy")
    assert recall["measured"] == pytest.approx(recall["by_path"]["recall"])
    assert recall["by_path"]["recall_device"] is None
    assert "judged without recall_device" in recall["note"] and "injected" in recall["note"]
    assert "recall (planned on the device)  skipped (RuntimeError: injected)" in format_report(data)


def test_decode_rows_and_ratios(cpu_run):
    rows = cpu_run[1]["decode"]
    assert [r["context"] for r in rows] == [1024, 2048]
    for r in rows:
        kv, dyn, off = (r["rows"][n] for n in ("kvtier", "dynamic", "offloading"))
        assert kv["steps"] == 2 and dyn["steps"] == 2 and kv["step_ms_median"] > 0
        for r_ in (kv, dyn):   # issuing a step is part of it (all of it on a CPU, where nothing runs behind)
            assert 0 < r_["issue_ms_median"] <= r_["step_ms_max"]
        assert r["ratios"]["dynamic_over_kvtier"] == pytest.approx(dyn["step_ms_median"] / kv["step_ms_median"],
                                                                  rel=1e-2)
        # DynamicCache's steps were timed in turn with kvtier's: each turn's ratio, and their median
        assert dyn["timed_in_turn_with_kvtier"] is True
        by_turn = statistics.median(d / k for d, k in zip(dyn["step_ms"], kv["step_ms"]))   # DynamicCache over kvtier
        assert r["ratios"]["dynamic_over_kvtier_by_turn"] == pytest.approx(by_turn, rel=2e-2)
        assert "skipped" in off and "cpu" in off["skipped"] and r["ratios"]["offloading_over_kvtier"] is None
        # no CUDA graphs nor prefetch on a CPU: the rows without them would be the kvtier row again
        assert "cpu" in r["rows"]["kvtier_eager"]["skipped"] and r["ratios"]["kvtier_eager_over_kvtier"] is None
        assert kv["cuda_graphs"]["replays"] == 0 and "capturing_warmup_ms" not in kv
        assert kv["cuda_graphs_timed"]["replays"] == kv["cuda_graphs_timed"]["captures"] == 0
        assert kv["tiers"]["host"]["tokens"] > 0 and kv["tiers"]["device"]["tokens"] > 0   # demoted, not dropped
        assert 0 < r["kvp_scoring"]["fraction_of_prefill"] and r["kvp_scoring"]["layers"] == 2
    # the memory-growth run comes last, at the smallest context, on a cache of its own
    growth = cpu_run[1]["growth"]
    assert growth["context"] == 1024 and list(cpu_run[1]["seconds"])[-2:] == ["growth", "total"]
    assert cpu_run[1]["settings"]["time_limit"] is None   # --time-limit 0: none
    assert growth["steps"] == 24 and growth["new_tokens"] == 24 and not growth["stopped_early"]
    assert growth["stopped_by"] is None
    # about one step in 18 demotes a page per head at 10% (the budget grows 0.1 token a step)
    assert 1 <= growth["demoting_steps"] < 24 and growth["demoting_step_ms_median"] > 0
    assert growth["other_step_ms_median"] > 0
    assert all("growth" not in r["rows"]["kvtier"] for r in rows)
    for r in rows:   # the one-graph row over a long decode: every step, its mean, how each ran (on a CPU: ordinary)
        run_ = r["rows"]["kvtier_graph"]["sustained"]
        assert run_["steps"] == 20 and run_["step_ms_mean"] > 0 and run_["demoting_steps"] >= 1, run_
        assert sum(run_["decode_graph"].values()) == 20 and run_["device_ok"] and run_["host_ok"], run_
        assert r["ratios"]["dynamic_over_kvtier_graph_sustained"] == pytest.approx(
            r["rows"]["dynamic"]["step_ms_median"] / run_["step_ms_mean"], rel=1e-2)
    for name in ("kvtier_no_prefetch", "kvtier_side_prefetch"):
        assert "skipped" in rows[1]["rows"][name] and name not in rows[0]["rows"]


def test_million_row(cpu_run):
    mil = cpu_run[1]["million"]
    assert mil["context"] == 8192 and mil["synthetic"] is True and 1 <= mil["layers"] <= 2
    assert mil["steps"] == 2 and mil["step_ms_median"] > 0
    assert mil["tiers"]["host"]["tokens"] > 0
    assert mil["projected_gpu_bytes_full_shape"] == mil["per_layer_gpu_bytes"] * 4
    assert mil["gpu_allocated_bytes"] is None   # no CUDA allocator: the cache's own pools are reported


def test_targets_have_values_and_verdicts(cpu_run):
    targets = {t["name"]: t for t in cpu_run[1]["targets"]}
    assert set(targets) == TARGETS
    for t in targets.values():
        assert {"target", "measured", "unit", "threshold", "pass", "note"} <= set(t)
    for name in ("demotion_vs_raw_copy", "recall_vs_raw_copy", "decode_vs_dynamic_gpu", "million_gpu_bytes",
                 "million_decode_vs_dynamic", "no_device_memory_growth", "no_host_memory_growth"):
        assert targets[name]["measured"] is not None, name
        # growth over 24 steps, not the target's 1,000: a verdict only where it already fails
        assert targets[name]["pass"] in ((None, False) if "growth" in name else (True, False)), name
    assert "the target's: 1,000" in targets["no_host_memory_growth"]["note"]
    assert targets["decode_vs_dynamic_gpu"]["context"] == 2048 and "128K" in targets["decode_vs_dynamic_gpu"]["note"]
    assert targets["decode_vs_offloading"]["pass"] is None and "cpu" in targets["decode_vs_offloading"]["note"]


def test_targets_prefer_128k_and_judge_both_ways():
    def row(context, kvtier, dynamic, offloading):
        return {"context": context, "rows": {"kvtier": {"step_ms_median": kvtier}, "dynamic": {"step_ms_median": dynamic},
                                             "offloading": {"step_ms_median": offloading}},
                "ratios": {"dynamic_over_kvtier": dynamic / kvtier, "offloading_over_kvtier": offloading / kvtier}}

    result = {"device": "cuda", "shape": {"layers": 32}, "seconds": {"total": 280.0},
              "bandwidth": {"raw_copy": {"host_to_device_gbps": 55.0, "device_to_host_gbps": 50.0},
                            "tiers": {"demotion": {"gbps": 46.0}, "recall": {"gbps": 20.0}}},
              "decode": [row(32768, 50.0, 56.0, 192.0), row(TARGET_CONTEXT, 60.0, 58.0, 986.0)]}
    got = {t["name"]: t for t in evaluate_targets(result)}
    assert got["demotion_vs_raw_copy"]["pass"] is True and got["recall_vs_raw_copy"]["pass"] is False
    assert got["decode_vs_dynamic_gpu"]["context"] == TARGET_CONTEXT and got["decode_vs_dynamic_gpu"]["pass"] is False
    assert got["decode_vs_offloading"]["measured"] == pytest.approx(986 / 60, rel=1e-3)
    assert got["decode_vs_offloading"]["pass"] is True and got["under_5_minutes"]["pass"] is True
    assert got["million_gpu_bytes"]["pass"] is None and "--no-million" in got["million_gpu_bytes"]["note"]
    assert got["no_device_memory_growth"]["pass"] is None
    # the command's own wall clock (start-up and imports included) is what the five minutes judge, where measured
    result["seconds"]["process"] = 310.0
    assert {t["name"]: t for t in evaluate_targets(result)}["under_5_minutes"]["pass"] is False


def test_disk_rows_plan_recall_on_the_device_and_on_the_host(cpu_run):
    """At the smallest context, two more kvtier rows with a host budget (every layer has pages on disk): recall
    planned on the device (a GPU's path, a read back a step) and on the host; each recalled pages from disk."""
    text, data = cpu_run
    first, second = data["decode"]
    assert "kvtier_disk" not in second["rows"] and "kvtier_disk_host_plan" not in second["rows"]
    for name in ("kvtier_disk", "kvtier_disk_host_plan"):
        r = first["rows"][name]
        assert r["step_ms_median"] > 0 and r["tiers"]["disk"]["tokens"] > 0, r
        assert r["tiers"]["pages_recalled_from"]["disk"] > 0
    ra = first["ratios"]
    assert ra["kvtier_disk_host_plan_over_kvtier_disk"] > 0 and ra["kvtier_disk_over_kvtier"] > 0
    assert "pages on disk, planned on host" in text and "planned on the host / on the device" in text


@pytest.mark.parametrize("args, words", [
    (["--disk-host-budget", "1.5"], "--disk-host-budget"),
    (["--disk-host-budget", "half"], "not a number"),
    (["--contexts", "abc"], "not a token count"),
    (["--contexts", "1K,"], "empty item"),
    (["--layers", "9"], "is too many"),
    (["--device-budget", "none"], "leaves no device tier"),
    (["--million-layers", "x"], "not a whole number"),
    (["--device", "tpu"], "--device"),
])
def test_mistakes_exit_2(args, words, tmp_path):
    result = run(*TINY, "--device", "cpu", "--out", str(tmp_path / "x.json"), *args)
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output


def test_contexts_beyond_what_a_bench_fills_exit_2(tmp_path):
    """A context of a trillion tokens had been taken, and the command sat allocating slabs with no output."""
    for option in ("--contexts", "--million-context"):
        result = run(*TINY, "--device", "cpu", "--out", str(tmp_path / "x.json"), option, "1e12")
        assert result.exit_code == 2 and "from 16 to 16,777,216" in result.output, result.output


def test_a_128k_context_that_failed_gives_no_verdict_from_a_smaller_one():
    """A smaller context stands in for 128K only where 128K was not asked for: one that failed (out of memory in
    its prefill, say) had the decode targets judged at 32K, with a note calling 32K the largest context run."""
    row = {"context": 32768, "rows": {"kvtier": {"step_ms_median": 50.0}, "dynamic": {"step_ms_median": 60.0}},
           "ratios": {"dynamic_over_kvtier": 1.2}}
    result = {"device": "cuda", "shape": {"layers": 32}, "seconds": {}, "bandwidth": {},
              "million": {"context": 2**20, "projected_gpu_bytes_full_shape": 2**34, "projection": "",
                          "step_ms_per_layer": 1.0},
              "decode": [row, {"context": TARGET_CONTEXT, "skipped": "OutOfMemoryError: CUDA out of memory"}]}
    got = {t["name"]: t for t in evaluate_targets(result)}
    for name in ("decode_vs_dynamic_gpu", "decode_vs_offloading", "million_decode_vs_dynamic"):
        assert got[name]["pass"] is None and "131,072-token context did not run (OutOfMemoryError" in \
            got[name]["note"], got[name]
    result["decode"].pop()   # not asked for: the largest context run stands in, and says so
    got = {t["name"]: t for t in evaluate_targets(result)}
    assert got["decode_vs_dynamic_gpu"]["pass"] is True and "largest context" in got["decode_vs_dynamic_gpu"]["note"]


def test_the_json_s_folder_is_made_before_the_work(tmp_path):
    """A folder that does not exist yet was taken, then the first checkpoint failed to write into it."""
    out = tmp_path / "new" / "deeper" / "gpu.json"
    result = run("bench", "gpu", "--shape", "tiny", "--layers", "1", "--contexts", "1K", "--no-million", "--steps",
                 "1", "--warmup", "1", "--growth-steps", "0", "--sustained-steps", "0", "--copy-mib", "1",
                 "--batch-mib", "1", "--threads", "1", "--time-limit", "0", "--device", "cpu", "--quiet",
                 "--no-decode-graph-row", "--disk-host-budget", "none", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["decode"][0]["context"] == 1024


def test_a_token_budget_above_the_context_times_the_pool_such_a_cache_holds():
    """`--device-budget 8192 --contexts 1K`: the 1K pool-attention row had timed a pool of 8,193 entries, where
    a cache of 1,024 tokens holds at most 1,024 (and the step's token)."""
    from kvtier.bench.gpu import Clock, GpuBenchConfig
    from kvtier.bench.gpu.pool_attention import measure_pool_attention

    cfg = GpuBenchConfig(device="cpu", shape="tiny", contexts=(1024,), device_budget=8192, repeats=1)
    row = measure_pool_attention(cfg, torch.device("cpu"), Clock(torch.device("cpu")), [1024])["rows"][0]
    assert row["entries"] == 1025


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_gpu_is_a_mistake(tmp_path):
    result = run(*TINY, "--out", str(tmp_path / "x.json"))
    assert result.exit_code == 2 and "no CUDA device" in result.output


@pytest.mark.cuda
def test_tiny_on_cuda_measures_every_row(tmp_path):
    out = tmp_path / "gpu.json"
    # 32 pages recalled a step: the 1K context's disk rows hold ~58 pages a layer and head, more than a step
    # recalls, so that pages rank after the choice and the prefetch has some to bring
    result = run(*TINY, "--recall-pages", "32", "--device", "cuda", "--out", str(out), "--quiet")
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["bandwidth"]["raw_copy"]["pinned"] is True and data["bandwidth"]["tiers"]["pinned"] is True
    for key in ("demotion", "recall", "recall_step", "recall_device"):   # timed by the device's events too
        row = data["bandwidth"]["tiers"][key]
        assert 0 < row["device_seconds"] and row["device_gbps"] > 0, row
    for r in data["decode"]:
        assert all("skipped" not in r["rows"][n] for n in ("kvtier", "dynamic", "offloading")), r["rows"]
        assert r["ratios"]["offloading_over_kvtier"] is not None
    assert data["million"]["gpu_allocated_bytes"] > 0
    assert data["growth"]["steps"] == 24 and not data["growth"]["stopped_early"], data["growth"]
    assert all(t["measured"] is not None for t in data["targets"]), data["targets"]
    cost = data["launch_cost"]   # with cupy, a native op is one kernel launch
    assert cost["torch_op_us"] > 0 and (cost["native_path"] == "kernel") == (kvtier_native_status() is None)
    for r in data["decode"]:   # --profile-steps: the device's kernels of a step, and its busy share
        prof = r["rows"]["kvtier"]["device_profile"]
        assert prof["device_busy_ms_per_step"] > 0 and prof["top"], prof
    for r in data["pool_attention"]["rows"]:   # the device's own time, from graphs; wide reads, same bits
        assert r["wide_same_bits"] and all(isinstance(v, float) and v > 0 for v in r["replayed_ms"].values()), r
    for r in data["decode"]:   # the kvtier row is the default cache: its timed steps replay from CUDA graphs
        graphs, timed = r["rows"]["kvtier"]["cuda_graphs"], r["rows"]["kvtier"]["cuda_graphs_timed"]
        assert graphs["failed"] is None and timed["replays"] > 0 and timed["prefetch_replays"] == 0, (graphs, timed)
        assert "skipped" not in r["rows"]["kvtier_eager"] and r["rows"]["kvtier_eager"]["cuda_graphs"]["replays"] == 0
        assert r["ratios"]["kvtier_eager_over_kvtier"] is not None
    for r in data["decode"]:   # over a long decode through DecodeGraph: demoting steps replayed, later states
        counts = r["rows"]["kvtier_graph"]["sustained"]["decode_graph"]   # captured the first step they are seen
        assert counts["replays"] > 0 and counts["eager"] == counts["ordinary"] == 0, counts
    top = data["decode"][-1]["rows"]
    assert "skipped" not in top["kvtier_no_prefetch"] and "skipped" not in top["kvtier_side_prefetch"], top
    assert top["kvtier_no_prefetch"]["tiers"]["prefetch"]["pages"] == 0
    assert top["kvtier_side_prefetch"]["cuda_graphs"]["prefetch"]["replays"] > 0   # on its side stream, from graphs
    assert top["kvtier"]["cuda_graphs"]["prefetch"]["replays"] == 0 and top["kvtier"]["tiers"]["prefetch"]["pages"] > 0
    assert "kvtier_no_prefetch" not in data["decode"][0]["rows"]
    disk = data["decode"][0]["rows"]["kvtier_disk"]   # pages on disk: planned on the device, never replayed
    assert "skipped" not in disk and disk["tiers"]["pages_recalled_from"]["disk"] > 0, disk
    assert disk["cuda_graphs_timed"]["replays"] == 0 and disk["tiers"]["prefetch"]["pages"] > 0
    assert "skipped" not in data["decode"][0]["rows"]["kvtier_disk_host_plan"]


def test_the_table_says_why_rows_were_skipped(cpu_run):
    """A skipped context, a skipped kvtier row and a skipped launch cost each print their reason, and the rest of
    the table still prints."""
    from kvtier.bench.gpu.report import format_report

    data = json.loads(json.dumps(cpu_run[1]))
    data["decode"][0] = {"context": 1024, "skipped": "out of memory (injected)"}
    data["decode"][1]["rows"]["kvtier"] = {"skipped": "a bug (injected)"}
    data["launch_cost"] = {"skipped": "no device (injected)"}
    text = format_report(data)
    assert "skipped: out of memory (injected)" in text and "a bug (injected)" in text
    assert "launch cost: skipped (no device (injected))" in text and "targets" in text


def test_a_device_profile_that_recorded_nothing_says_so(cpu_run):
    """Decode steps on a GPU always run kernels: a profile of none is the profiler's failure, reported as such
    (in the JSON and the table), never a device busy 0% of the step."""
    from types import SimpleNamespace

    from kvtier.bench.gpu.host_profile import kernel_summary
    from kvtier.bench.gpu.report import format_report

    idle = SimpleNamespace(key="cudaLaunchKernel", count=8, self_device_time_total=0.0)
    empty = kernel_summary([idle], [0.040, 0.050], 2)
    assert "no_device_activity" in empty and "device_busy_ms_per_step" not in empty and "top" not in empty
    assert empty["step_ms_profiled"] == [40.0, 50.0]
    busy = kernel_summary([idle, SimpleNamespace(key="gemm", count=4, self_device_time_total=30_000.0)],
                          [0.040, 0.050], 2)
    assert busy["device_busy_ms_per_step"] == 15.0 and busy["device_busy_share"] == pytest.approx(15 / 50)
    assert busy["top"] == [{"kernel": "gemm", "calls_per_step": 2.0, "device_ms_per_step": 15.0}]
    data = json.loads(json.dumps(cpu_run[1]))
    data["decode"][0]["rows"]["kvtier"]["device_profile"] = empty
    data["decode"][0]["rows"]["dynamic"]["device_profile"] = busy
    text = format_report(data)
    assert "1K device profile empty (the profiler recorded no kernel): kvtier" in text
    assert "1K device busy per step (kernels and copies): DynamicCache 15.00 ms (30%)" in text


def test_a_context_is_checkpointed_after_each_of_its_rows():
    """A run cut short in the middle of a context (the 128K one is a minute and a half on the H200) keeps the
    rows that context finished: a checkpoint after each row holds the context's row so far, marked partial."""
    from kvtier.bench.gpu import GpuBenchConfig, run_gpu_bench

    seen = []
    cfg = GpuBenchConfig(device="cpu", shape="tiny", layers=1, contexts=(1024,), million=False, copy_mib=1,
                         batch_mib=1, repeats=1, steps=2, warmup=1, growth_steps=4, sustained_steps=0,
                         prefill_chunk=512, disk_host_budget=None)
    final = run_gpu_bench(cfg, checkpoint=lambda c: seen.append(json.loads(json.dumps(c))))   # written at once
    within = [c for c in seen if c["last_section"] == "context_1024"]
    assert len(within) >= 3   # after each row the CPU runs (kvtier, DynamicCache), then the whole context
    sofar = [set(c["decode"][-1]["rows"]) for c in within[:-1]]
    assert all(c["decode"][-1]["partial"] is True for c in within[:-1])
    assert all(a < b for a, b in zip(sofar, sofar[1:])) and sofar[-1] == set(final["decode"][0]["rows"])
    assert "partial" not in within[-1]["decode"][-1] and within[-1]["decode"] == final["decode"]


def test_a_device_that_cannot_be_freed_is_said_in_the_row_and_the_run_goes_on(monkeypatch):
    """After a row left the device in an error state, freeing its memory fails too: the row records both
    reasons, and nothing escapes to end the run before its JSON is written."""
    from kvtier.bench.gpu.timing import Progress, _attempt, _free

    def stuck(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", stuck)
    cuda = torch.device("cuda", 0)
    assert "illegal memory access" in _free(cuda)
    assert _free(torch.device("cpu")) is None

    def row():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    out = _attempt("128K kvtier", row, cuda, Progress(False))
    assert out["skipped"].startswith("RuntimeError: CUDA error: an illegal memory access")
    assert "the device could not be freed after it (RuntimeError: CUDA error" in out["skipped"]


def test_every_checkpoint_carries_the_targets_judged_so_far():
    """A run cut short (a lease, a timeout) keeps its last checkpoint: each says where the targets stand."""
    from kvtier.bench.gpu import GpuBenchConfig, run_gpu_bench

    seen = []
    cfg = GpuBenchConfig(device="cpu", shape="tiny", layers=1, contexts=(), million=False, copy_mib=1, batch_mib=1,
                         repeats=1)
    began = time.time() - 30.0   # as if the command had started 30 s before the run (its imports, say)
    final = run_gpu_bench(cfg, checkpoint=seen.append, started=began)
    assert [c["last_section"] for c in seen] == ["bandwidth", "launch_cost", "pool_attention"]
    for c in seen:
        assert c["partial"] is True and {t["name"] for t in c["targets"]} == TARGETS
    bw = {t["name"]: t for t in seen[0]["targets"]}
    assert bw["demotion_vs_raw_copy"]["measured"] is not None   # judged from the first section on
    assert {t["name"] for t in final["targets"]} == TARGETS and "partial" not in final
    assert final["seconds"]["process"] >= 30.0 + final["seconds"]["total"] - 0.5
    judged = {t["name"]: t for t in final["targets"]}["under_5_minutes"]
    assert judged["measured"] == final["seconds"]["process"]


def test_a_failure_after_a_rows_timed_steps_keeps_them(monkeypatch):
    """A row's profiles and long runs (the 1M row's steps through `DecodeGraph`) come after its timed steps: a
    failure in one is recorded under its own name, and the row keeps the steps the targets judge, in the JSON, the
    table and the targets. The memory-growth run, a section of its own, fails alone too."""
    from kvtier.bench.gpu import GpuBenchConfig, context, run_gpu_bench
    from kvtier.bench.gpu.report import format_report
    from kvtier.integrations import model_graph

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(context, "_growth", broken)
    monkeypatch.setattr(model_graph.DecodeGraph, "__init__", broken)   # the 1M row's (and the one-graph row's)
    cfg = GpuBenchConfig(device="cpu", shape="tiny", layers=1, contexts=(1024,), million_context=8192, copy_mib=1,
                         batch_mib=1, repeats=1, steps=2, warmup=1, growth_steps=4, sustained_steps=0,
                         prefill_chunk=512, disk_host_budget=None, decode_graph=True)
    result = run_gpu_bench(cfg)
    row = result["decode"][0]["rows"]["kvtier"]
    assert row["step_ms_median"] > 0 and "skipped" not in row
    assert result["growth"]["skipped"].startswith("RuntimeError: CUDA error: an illegal memory access")
    assert result["decode"][0]["rows"]["dynamic"]["timed_in_turn_with_kvtier"] is True
    mil = result["million"]
    assert mil["step_ms_median"] > 0 and mil["decode_graph"]["skipped"].startswith("RuntimeError: CUDA error")
    judged = {t["name"]: t for t in result["targets"]}
    assert judged["million_gpu_bytes"]["measured"] is not None
    assert judged["no_device_memory_growth"]["measured"] is None
    assert judged["no_device_memory_growth"]["note"].startswith("growth run skipped: RuntimeError")
    text = format_report(result)
    assert "memory growth run skipped (RuntimeError" in text and "stepped by DecodeGraph: skipped (Runtime" in text


def test_the_growth_run_keeps_to_the_time_limit():
    """The memory-growth run comes last and takes what the time limit leaves: none left, it is skipped and says
    why; stopped by the limit, it says so and the target gives no verdict. The other rows run as they would."""
    from kvtier import TieredCache, cache_kwargs
    from kvtier.bench.gpu import GpuBenchConfig, run_gpu_bench
    from kvtier.bench.gpu.growth import _growth
    from kvtier.bench.gpu.model import build_model
    from kvtier.bench.gpu.timing import Clock, Progress
    from kvtier.errors import ConfigError

    cfg = GpuBenchConfig(device="cpu", shape="tiny", layers=1, contexts=(1024,), million=False, copy_mib=1,
                         batch_mib=1, repeats=1, steps=2, warmup=1, growth_steps=4, sustained_steps=0,
                         prefill_chunk=512, disk_host_budget=None, eager=False, decode_graph=False, time_limit=60.0)
    late = run_gpu_bench(cfg, started=time.time() - 90.0)   # the command began longer ago than its limit
    assert late["decode"][0]["rows"]["kvtier"]["step_ms_median"] > 0
    assert "left under the time limit of 60 s" in late["growth"]["skipped"], late["growth"]
    judged = {t["name"]: t for t in late["targets"]}
    assert judged["no_host_memory_growth"]["pass"] is None and "--time-limit" in judged["no_host_memory_growth"]["note"]

    model, _ = build_model("tiny", 1, torch.device("cpu"), 0)
    with TieredCache(model.config, device_budget=0.1, scorer="keynorm") as cache, torch.no_grad():
        model(torch.arange(300)[None], **cache_kwargs(cache))
        cut = _growth(cfg, model, cache, torch.tensor([[5]]), 1, Clock(torch.device("cpu")), Progress(False),
                      deadline=time.perf_counter())
    assert cut["steps"] == 1 and cut["stopped_early"] and cut["stopped_by"] == "time_limit"
    note = evaluate_targets({"growth": cut, "decode": [], "bandwidth": {}})
    growth_note = next(t for t in note if t["name"] == "no_device_memory_growth")
    assert growth_note["pass"] is None and growth_note["note"] == "1 of 4 steps (stopped at --time-limit)"
    with pytest.raises(ConfigError, match="time_limit=0"):
        GpuBenchConfig(device="cpu", time_limit=0)
