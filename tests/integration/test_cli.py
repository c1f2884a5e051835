"""The command line through click's runner: exit codes, --json shapes, errors for bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvtier.cli import main

pytestmark = pytest.mark.slow


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


def test_info_json():
    result = run("info", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert {"versions", "memory", "gpus", "memlock", "disk", "limits"} <= set(data)
    assert data["versions"]["kvtier"]


@pytest.mark.parametrize("args, words", [
    (["demo", "--device-budget", "-1"], "device_budget=-1 is out of range"),
    (["demo", "--host-budget", "2.5"], "host_budget=2.5 is out of range"),
    (["demo", "--model", "/no/such/model"], "neither a local path"),
    (["chat", "--device-budget", "0"], "device_budget=0"),
])
def test_user_mistakes_exit_2_without_traceback(args, words):
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output


def test_unwritable_disk_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = run("demo", "--disk-dir", str(blocker / "sub"))
    assert result.exit_code == 2 and "not a writable folder" in result.output


def test_long_context_needs_synthetic():
    result = run("demo", "--context", "1M")
    assert result.exit_code == 2 and "--synthetic" in result.output


def test_synthetic_demo_json():
    result = run("demo", "--synthetic", "--context", "32K", "--needles", "2", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["synthetic"] is True and data["context"] == 32768
    assert all(n["recalled"] for n in data["needles"])
    assert data["usage"]["disk"]["tokens"] > 0 and data["settings"]["scorer"] == "keynorm"
    # the page file counts as the disk's reserved bytes, as in stats() (it had been left out: 0 reserved)
    assert data["usage"]["disk"]["reserved_bytes"] >= data["usage"]["disk"]["bytes"] > 0
    result = run("demo", "--synthetic", "--context", "32K", "--needles", "1", "--scorer", "random", "--json")
    assert result.exit_code == 0 and json.loads(result.output)["settings"]["scorer"] == "random"   # it had been ignored


def test_demo_json_on_the_default_model():
    result = run("demo", "--context", "1200", "--needles", "1", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    task = data["tasks"][0]
    assert {"full", "tiered", "stats", "key"} <= set(task) and task["stats"]["scorer"] == "kvp"
    assert data["correct"]["tiered"] == data["correct"]["full"] == 1
    # as the text says, the scorer "auto" resolved to (it had been missing)
    assert data["settings"] == {"device_budget": 0.1, "host_budget": 0.2, "recall_pages": 32, "scorer": "kvp"}


def test_chat_json_parks_between_turns():
    result = run("chat", "--json", "--park", "disk", "--max-new-tokens", "8", input="Hello!\nAnd again?\n")
    assert result.exit_code == 0, result.output
    turns = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert [t["turn"] for t in turns] == [1, 2]
    last = turns[-1]
    assert last["parked"] == "disk" and last["device"]["tokens_per_head"] == 0
    # per layer and KV head, as the text shows: never more than the conversation's tokens (a sum over them had been)
    assert 0 < last["disk"]["tokens_per_head"] <= last["tokens"]
    assert "decode_graph" not in turns[-1]
    stepped = run("chat", "--json", "--park", "disk", "--max-new-tokens", "8", "--decode-graph",
                  input="Hello!\nAnd again?\n")
    assert stepped.exit_code == 0, stepped.output
    again = [json.loads(line) for line in stepped.output.splitlines() if line.startswith("{")]
    assert [t["reply"] for t in again] == [t["reply"] for t in turns]
    # on a CPU, recall is planned on the host: every step the ordinary way, none planned whole
    assert again[-1]["decode_graph"]["ordinary"] > 0 and again[-1]["decode_graph"]["replays"] == 0


def test_bench_prefetch_text_where_no_page_is_ever_chosen():
    """A device budget that holds the whole prompt chooses no page: the share of chosen pages already on the device
    has no value, and the table says so with a dash."""
    result = run("bench", "prefetch", "--context", "300", "--device-budget", "1.0", "--new-tokens", "2",
                 "--prefetch-pages", "0")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-3].split()[:2] == ["0", "-"]


def test_bench_prefetch_json():
    """Recall planned on the device, as on a GPU: prefetching raises the share of chosen pages already on the
    device, and the tokens do not change."""
    result = run("bench", "prefetch", "--context", "600", "--new-tokens", "6", "--recall-pages", "4",
                 "--prefetch-pages", "0,4", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert data["same_tokens"] is True
    plain, ahead = data["rows"]
    assert (plain["prefetch_pages"], ahead["prefetch_pages"]) == (0, 4)
    assert plain["pages_prefetched"] == 0 and plain["prefetch_hit_rate"] is None
    assert ahead["pages_prefetched"] > 0 and plain["pages_chosen"] == ahead["pages_chosen"] > 0
    assert ahead["on_device_when_chosen"] > plain["on_device_when_chosen"]
    assert ahead["pages_on_demand"] < plain["pages_on_demand"]


def test_bench_json():
    result = run("bench", "decode", "--context", "256", "--new-tokens", "4", "--rounds", "1", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert [r["cache"] for r in data["results"]] == ["DynamicCache", "TieredCache"]
    assert data["machine"]["threads"] == 1


@pytest.mark.parametrize("disk", ["--cold-disk", "--warm-disk"])
def test_bench_resume_json(disk):
    """`kvtier bench resume`: a row never parked, then, parked on the host and on disk, one restored on demand and
    one per think time, each starting from a copy of the same cache; every row's logits the same bits, the rows
    prefetched taking every layer; parked on the host, a copy holds less host memory than live (the host pool's
    slabs, in part empty, go), and live no more than the cache that ran the prompt."""
    result = run("bench", "resume", "--context", "400", "--rounds", "1", "--think-ms", "0,20", "--scorer",
                 "keynorm", disk, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert data["identical_logits"] is True and data["settings"]["cold_disk"] is (disk == "--cold-disk")
    names = [r["row"] for r in data["rows"]]
    assert names == ["never parked", "parked on the host", "host, prefetch 0 ms later", "host, prefetch 20 ms later",
                     "restored on demand", "prefetch, 0 ms later", "prefetch, 20 ms later"]
    assert [r["layers_read_ahead"] for r in data["rows"]] == [0, 0, 30, 30, 0, 30, 30]
    assert data["parked_disk_bytes"] > 0 and all(r["first_token_ms"] > r["restore_ms"] >= 0 for r in data["rows"])
    assert all(r["restore_ms"] > 0 for r in data["rows"][1:])
    assert 0 < data["parked_host_reserved_bytes"] < data["live_host_reserved_bytes"]
    assert data["live_host_reserved_bytes"] <= data["prefilled_host_reserved_bytes"]


def test_bench_decode_cold_disk(monkeypatch):
    """`--cold-disk` drops the page file from the page cache before every timed step of the kvtier rows (the
    data stays: the rows still decode), and says so in the JSON with the read-ahead counters; `--read-ahead`
    gives one row per setting (with it off, no page is read ahead)."""
    from kvtier.tiers.disk import DiskStore

    drops = []
    drop = DiskStore.drop_cached
    monkeypatch.setattr(DiskStore, "drop_cached", lambda self: drops.append(self.path) or drop(self))
    result = run("bench", "decode", "--context", "1500", "--new-tokens", "6", "--rounds", "1", "--device-budget",
                 "0.25", "--host-budget", "0.25", "--scorer", "keynorm", "--cold-disk", "--read-ahead", "auto,off",
                 "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert data["settings"]["cold_disk"] is True and len(drops) == 12
    assert data["settings"]["read_ahead"] == ["auto", "off"]
    auto, off = data["results"][1:]
    assert (auto["cache"], off["cache"]) == ("TieredCache ra=auto", "TieredCache ra=off")
    assert (auto["settings"]["read_ahead"], off["settings"]["read_ahead"]) == ("auto", "off")
    assert {"hits", "misses", "steps_paused"} <= set(auto["read_ahead"]) and auto["read_ahead"]["pages_read_ahead"]
    assert off["read_ahead"]["pages_read_ahead"] == 0 and off["read_ahead"]["hits"] == 0


def test_bench_decode_rows_per_promote_setting():
    """`--promote on,off`: one row each, with their settings and counters; the host tier keeps disk pages only
    where promotion is on, and the disk is read less there."""
    result = run("bench", "decode", "--context", "1000", "--new-tokens", "12", "--recall-pages", "16", "--rounds",
                 "1", "--device-budget", "0.25", "--host-budget", "0.25", "--scorer", "keynorm", "--promote", "on,off",
                 "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert data["settings"]["promote"] == ["on", "off"]
    on, off = data["results"][1:]
    assert (on["cache"], off["cache"]) == ("TieredCache promote=on", "TieredCache promote=off")
    assert (on["settings"]["promote"], off["settings"]["promote"]) == ("on", "off")
    assert on["promotion"]["pages"] > 0 and off["promotion"]["pages"] == 0
    assert on["pages_recalled_from"]["disk"] < off["pages_recalled_from"]["disk"]


def test_bench_decode_rows_per_retain_pages_setting():
    """`--retain-pages 0,8`: one row each, with its setting; the buffer that keeps pages no longer chosen brings
    fewer up, and finds them again (reused)."""
    result = run("bench", "decode", "--context", "1000", "--new-tokens", "12", "--recall-pages", "16", "--rounds",
                 "1", "--device-budget", "0.25", "--host-budget", "0.25", "--scorer", "keynorm", "--retain-pages",
                 "0,8", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert data["settings"]["retain_pages"] == [0, 8]
    plain, kept = data["results"][1:]
    assert (plain["cache"], kept["cache"]) == ("TieredCache retain=0", "TieredCache retain=8")
    assert (plain["settings"]["retain_pages"], kept["settings"]["retain_pages"]) == (0, 8)
    moved = [sum(r["pages_recalled_from"].values()) for r in (plain, kept)]
    assert moved[1] < moved[0] and kept["pages_reused"] > plain["pages_reused"]


def test_bench_decode_rows_per_demote_pages():
    """One TieredCache row per demote_pages setting, each with its demotions; a bad setting is refused by name."""
    result = run("bench", "decode", "--context", "600", "--new-tokens", "36", "--rounds", "1", "--device-budget",
                 "0.1", "--demote-pages", "1,4", "--scorer", "keynorm", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    rows = {r["cache"]: r for r in data["results"]}
    assert list(rows) == ["DynamicCache", "TieredCache d=1", "TieredCache d=4"]
    assert rows["TieredCache d=1"]["demotions"] > rows["TieredCache d=4"]["demotions"] > 0
    for bad, words in (("0", "has 0"), ("1,x", "has 'x'")):
        refused = run("bench", "decode", "--demote-pages", bad)
        assert refused.exit_code == 2 and "--demote-pages" in refused.output and words in refused.output
        assert "comma list of whole numbers >= 1" in refused.output


def test_bench_launches_with_disk_pages_planned_on_the_device_and_on_the_host():
    """With a host budget the layers have pages on disk: planned on the device (a GPU's path), a step copies host
    and disk pages by the recall kernels and attends to them where the buffer holds them; planned on the host,
    no plan on the device."""
    result = run("bench", "launches", "--context", "320", "--steps", "1", "--recall-pages", "4", "--host-budget",
                 "0.2", "--plan-recall", "device,host", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert data["settings"]["host_budget"] == 0.2 and data["settings"]["plan_recall"] == ["device", "host"]
    rows = {r["cache"]: r for r in data["rows"]}
    assert list(rows) == ["DynamicCache", "TieredCache plan=device", "TieredCache plan=host"]
    device, host = rows["TieredCache plan=device"], rows["TieredCache plan=host"]
    assert device["native_calls_per_layer_step"]["plan_recall"] == device["native_calls_per_layer_step"]["recall_pages"]
    assert device["native_calls_per_layer_step"]["attend_pages"] >= 1
    assert "plan_recall" not in host["native_calls_per_layer_step"] and host["by_part_per_layer_step"]["model"] > 0


def test_bench_launches_json():
    """kvtier's decode step, recall planned on the device, issues more launches per layer than DynamicCache's,
    and the count says where they come from; the plan is one native call per recall."""
    result = run("bench", "launches", "--context", "320", "--steps", "1", "--recall-pages", "4", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    plain, tiered = data["rows"]
    assert plain["cache"] == "DynamicCache" and set(plain["by_part_per_layer_step"]) == {"model"}
    assert tiered["launches_per_layer_step"] > plain["launches_per_layer_step"] > 0
    assert {"page choice", "scorer", "model"} <= set(tiered["by_part_per_layer_step"])
    calls, parts = tiered["native_calls_per_layer_step"], tiered["by_part_per_layer_step"]
    # the recall is its native calls alone: the plan writes the buffer's table in place, no torch op is left
    assert calls["plan_recall"] >= 1 and "recall and prefetch" not in parts
    # page ranking and KVP's networks are a launch each; keys and values recalled together
    assert calls["rank_pages"] == calls["kvp_score"] == 1
    assert calls["recall_pages"] == calls["plan_recall"]
    # the host time in each cache's own code was measured (kvtier's twins left out)
    assert plain["cache_host_us_per_layer_step"] > 0 and tiered["cache_host_us_per_layer_step"] > 0
    # of which the launches-only work CUDA graphs replay: the write (KVP's scores, the NaN check's maximum, the
    # pool's three copies), the pool's and the pages' attention, the choice and the recall (9 launches), the
    # commit (the score's copy, the count's add_) and the prefetch's plan and copy; not the demotions
    assert plain["captured_launches_per_layer_step"] is None and plain["captured_host_us_per_layer_step"] is None
    assert 16 <= tiered["captured_launches_per_layer_step"] <= 20, tiered["captured_launches_per_layer_step"]
    # at most all of kvtier's own (the demotions, where the counted steps hold one, and the step's position stay out)
    assert tiered["captured_launches_per_layer_step"] <= tiered["launches_per_layer_step"] - parts["model"]
    assert 0 < tiered["captured_host_us_per_layer_step"] < tiered["cache_host_us_per_layer_step"]
    # and beside it, what looking the graphs up costs (the step's key and its prefetch's), measured for kvtier only
    assert plain["graph_key_host_us_per_layer_step"] is None
    assert 0 < tiered["graph_key_host_us_per_layer_step"] < tiered["cache_host_us_per_layer_step"]
    # the device pool in one pass (its chunks, and their combine if several), then the recalled pages where the
    # buffer holds them, merged with it: no attention call, no gather, no separate merge
    assert calls["attend_slabs"] >= 1 and calls["attend_pages"] == 2 and "merge_parts" not in calls
    assert parts["page choice"] <= 3 and "attention over the parts" not in parts   # a top-k
    assert data["ratio"] > 1
    # a step replayed whole: what the host still does, and in how many states (a capture each) its steps ran
    whole = data["decode_graph_host_us_per_layer_step"]
    assert whole["planned_steps"] == whole["steps"] == 1 and whole["states"] == 1 and whole["total"] > 0, whole


def test_bench_wrappers_json():
    """The host cost of kvtier's own code per native call, at two contexts, next to a torch op's."""
    result = run("bench", "wrappers", "--contexts", "16K,64K", "--calls", "10", "--device-budget", "0.5", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert [r["context"] for r in data["rows"]] == [16_384, 65_536] and data["torch_op_us"] > 0
    # the settings it ran with (its method had always said 10% on the device)
    assert data["settings"] == {"device_budget": 0.5, "calls": 10} and "0.5 of the context" in data["method"]
    assert data["rows"][0]["device_entries"] == 8192
    assert set(data["rows"][0]["us_per_call"]) == set(data["calls_per_layer_step"])
    bad = run("bench", "wrappers", "--contexts", "12")
    assert bad.exit_code != 0 and "--contexts" in bad.output


def test_chat_disk_dir_with_a_tilde_after_equals_is_the_home_folder(tmp_path, monkeypatch):
    """`--disk-dir=~/x` reaches the program unexpanded: the check expanded it, the cache then made a folder named
    '~' in the current folder (and left it there)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path)
    result = run("chat", "--json", "--park", "disk", "--max-new-tokens", "2", "--disk-dir=~/kv", input="Hello!\n")
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "~").exists() and (tmp_path / "home" / "kv").is_dir()


@pytest.mark.parametrize("command", [["chat", "--max-new-tokens", "2"], ["demo", "--context", "256", "--needles", "1"]])
def test_a_model_without_a_chat_template_is_refused_in_one_line(command, monkeypatch, default_model):
    """A base model's tokenizer has no chat template: transformers' error came as a traceback (exit 1), for chat
    after the first line typed."""
    import copy
    import importlib

    model, tok = default_model
    base = copy.copy(tok)
    base.chat_template = None
    for name in ("kvtier.cli.chat", "kvtier.cli.demo"):   # the modules (the package names the commands alike)
        monkeypatch.setattr(importlib.import_module(name), "load", lambda *args, **kwargs: (model, base))
    result = run(*command, input="Hello!\n")
    assert result.exit_code == 2 and "has no chat template" in result.output and "'--model'" in result.output
