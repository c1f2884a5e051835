"""The launch count of `kvtier bench launches`: what is counted as a kernel launch, and what is not."""

from __future__ import annotations

import pytest
import torch

from kvtier import native
from kvtier.bench.launches import LaunchCounter, part_of, _PACKAGE


def test_views_are_free_and_every_other_op_is_one_launch():
    x = torch.randn(4, 6)
    with LaunchCounter() as c:
        y = x.view(6, 4)[1:5].t().unsqueeze(0)     # views: no kernel
        z = (y * 2 + 1).sum()                      # mul, add, sum
        y.reshape(16)                              # a reshape that must copy: a kernel
    assert c.ops == {"mul": 1, "add": 1, "sum": 1, "clone": 1} and c.parts == {"model": 4}
    with LaunchCounter() as c:
        bool(z > 0)                                # gt, then the host reads the device's answer
    assert c.host_reads == 1 and c.ops["gt"] == 1


def test_a_native_twins_ops_are_not_counted_the_call_is_by_the_backend():
    want = torch.tensor([[3, 1, 4]])
    held = torch.tensor([[1, -1, 5, 9]])
    before = native.backend()["ops"].get("plan_recall", {"kernel": 0, "twin": 0})
    with LaunchCounter() as c:
        native.plan_recall(want, held, 10)
    after = native.backend()["ops"]["plan_recall"]
    assert after["kernel"] + after["twin"] == before["kernel"] + before["twin"] + 1
    assert sum(c.parts.values()) == 0              # the twin's dozen ops stand for one kernel launch


def test_parts_follow_the_file_that_issued_the_op():
    assert part_of(_PACKAGE + "scoring/kvp.py") == "scorer"
    assert part_of(_PACKAGE + "recall/selector.py") == "page choice"
    assert part_of(_PACKAGE + "recall/device_plan.py") == "recall and prefetch"
    assert part_of(_PACKAGE + "engine/fetch.py") == "recall and prefetch"
    assert part_of(_PACKAGE + "engine/layer.py") == "placement and bookkeeping"


def test_a_dry_run_takes_every_kernel_path_launches_nothing_and_ends_cleanly():
    """`kvtier bench wrappers` times the ops' own code under `loader.dry_run`: each takes its kernel path on
    the CPU's tensors (what it builds for the launch is what it would build on a GPU), no kernel is built or
    launched, and outside it the twins run again."""
    from kvtier.bench.wrappers import CALLS, _Step
    from kvtier.native import loader

    step = _Step(20_000, 0.1)
    marker = float("nan")
    step.part[0].fill_(marker)
    native.reset_stats()
    with loader.dry_run():
        assert native.kernel_status() is None
        for op, call in step.calls().items():
            call()
            assert native.backend()["ops"][op]["last"] == "kernel", op
    assert set(native.backend()["ops"]) == set(CALLS)
    assert native.kernel_status() is not None            # no CUDA here: the twins again
    out, _ = native.merge_parts([step.part, step.part])
    assert native.backend()["ops"]["merge_parts"]["last"] == "twin" and torch.isnan(out).all()


def test_the_wrapper_bench_reports_every_call_at_every_context():
    from kvtier.bench.wrappers import CALLS, measure_wrapper_cost

    out = measure_wrapper_cost([16_384, 65_536], n=20)
    assert [r["context"] for r in out["rows"]] == [16_384, 65_536]
    for r in out["rows"]:
        assert set(r["us_per_call"]) == set(CALLS) and all(v > 0 for v in r["us_per_call"].values())
        assert r["us_per_layer_step"] == pytest.approx(sum(r["us_per_call"][k] * n for k, n in CALLS.items()),
                                                       abs=0.5)
    assert out["rows"][1]["host_slabs"] > out["rows"][0]["host_slabs"]


def test_the_host_clock_counts_the_cache_methods_less_the_twins_inside_them():
    import time

    from kvtier.bench.launches import HostClock, _clocked
    from kvtier.native import twins

    clock = HostClock()
    twin = clock.twin(lambda: time.sleep(0.3))
    inner = clock.method(lambda: (time.sleep(0.05), twin()))
    outer = clock.method(lambda: (inner(), time.sleep(0.05)))   # a method calling another: counted once
    outer()
    twin()                                                      # a twin outside the cache's methods: not counted
    assert 0.6 > clock.inside >= 0.4 and 0.6 > clock.twins >= 0.3   # counted twice, inside would be 0.75
    assert clock.host == clock.inside - clock.twins >= 0.1

    real = twins.plan_recall
    with _clocked(object(), clock):
        assert twins.plan_recall is not real                    # every twin function is timed within
        assert twins.RecallPlan.__module__ == twins.__name__    # its classes are left alone
    assert twins.plan_recall is real                            # and put back after


def test_the_host_clock_times_the_work_a_graph_replays_less_the_twins_in_it():
    import time

    from kvtier.bench.launches import HostClock

    clock = HostClock()
    twin = clock.twin(lambda: time.sleep(0.2))

    def step():
        time.sleep(0.05)          # bookkeeping around the work
        clock.enter_work()
        time.sleep(0.1)           # the work's own host time
        twin()                    # a twin inside it: left out of both
        clock.leave_work()

    clock.method(step)()
    assert 0.2 > clock.work_host >= 0.1 and 0.35 > clock.host >= 0.15 and clock.work_host < clock.host
