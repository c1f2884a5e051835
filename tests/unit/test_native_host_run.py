"""The plan kernel's own code, compiled for the host with `nvcc`, gives the twin's plan.

`native/plan_recall.cu` keeps its logic in ``__host__ __device__`` functions: the marking shared by a
block's threads, then the assignment one thread makes. A small host program runs them (the threads' share of
the marking as lanes in turn) over many random buffers, and each plan must equal `twins.plan_recall`, id for
id. What only a GPU shows (shared memory, the barrier, the launch) is `tests/cuda`'s; skipped without nvcc.
"""

from __future__ import annotations

import subprocess

import torch

from kvtier.native import twins

from native_host import harness_fixture
from test_native_compile import needs_nvcc

HARNESS = r"""
#include "plan_recall.cu"
#include <cstdio>
#include <vector>
// Cases from stdin until its end, each: heads w R pages lanes prefetch given in_place, want [heads * w], held
// [heads * R], host_slots [heads * pages], ahead [heads * R] (0/1), counts [4] (the last three passed to the
// kernel's functions only if `given`, else null; with `in_place` held_after is held); for each, one line:
// fetch | slots | count | held_after | where | src_rows | dst_rows | ahead | counts.
static bool read(std::vector<kv_i64>& v) {
    for (auto& x : v) if (scanf("%lld", &x) != 1) return false;
    return true;
}
int main() {
    long long heads, w, R, pages, lanes, prefetch, given, in_place;
    while (scanf("%lld %lld %lld %lld %lld %lld %lld %lld", &heads, &w, &R, &pages, &lanes, &prefetch, &given,
                 &in_place) == 8) {
        std::vector<kv_i64> want(heads * w), held(heads * R), host(heads * pages), flags(heads * R), counts(4),
            fetch(heads * w), slots(heads * w), count(heads), after(heads * R), where(heads * w), src(heads * w),
            dst(heads * w);
        if (!read(want) || !read(held) || !read(host) || !read(flags) || !read(counts)) return 2;
        std::vector<unsigned char> ahead(flags.begin(), flags.end()), marks(w + R + 1);
        kv_i64* table = in_place ? held.data() : after.data();
        for (kv_i64 h = 0; h < heads; ++h) {   // a block: its threads' shares of a step as lanes in turn
            for (kv_i64 lane = 0; lane < lanes; ++lane) {
                kv_plan_marks(&want[h * w], w, &held[h * R], R, given ? &host[h * pages] : nullptr, pages,
                              (int)prefetch, marks.data(), marks.data() + w, &table[h * R], lane, lanes);
            }
            kv_plan_assign(&want[h * w], w, R, marks.data(), marks.data() + w, &fetch[h * w], &slots[h * w],
                           &count[h], &table[h * R]);
            for (kv_i64 lane = 0; lane < lanes; ++lane) {
                kv_plan_rows(&want[h * w], w, R, h, given ? &host[h * pages] : nullptr, pages, &fetch[h * w],
                             &slots[h * w], &table[h * R], &where[h * w], &src[h * w], &dst[h * w], lane, lanes);
            }
            kv_plan_flags(w, &slots[h * w], &count[h], &where[h * w], given ? &ahead[h * R] : nullptr,
                          given ? counts.data() : nullptr, (int)prefetch);
        }
        if (in_place) after = held;
        for (auto v : {&fetch, &slots, &count, &after, &where, &src, &dst}) {
            for (auto x : *v) printf("%lld ", x);
            printf("| ");
        }
        for (auto x : ahead) printf("%d ", (int)x);
        printf("| ");
        for (auto x : counts) printf("%lld ", x);
        printf("\n");
    }
    return 0;
}
"""


harness = harness_fixture(HARNESS, "plan")


def _case(g: torch.Generator, heads: int, w: int, R: int, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct wanted pages per head, and a buffer of distinct pages (some empty) overlapping them."""
    want = torch.stack([torch.randperm(pages, generator=g)[:w] for _ in range(heads)])
    held = torch.full((heads, R), -1, dtype=torch.int64)
    for h in range(heads):
        ids = torch.randperm(pages, generator=g)[:R]
        keep = torch.rand(R, generator=g) < 0.7
        held[h] = torch.where(keep, ids, torch.full_like(ids, -1))
    return want, held


@needs_nvcc
def test_the_plan_kernels_code_gives_the_twins_plan(harness):
    g = torch.Generator().manual_seed(0)
    cases, lines = [], []
    for i in range(300):
        heads = int(torch.randint(1, 5, (1,), generator=g))
        w = int(torch.randint(0, 12, (1,), generator=g))
        R = w + int(torch.randint(0, 10, (1,), generator=g))
        pages = max(w, R) + int(torch.randint(0, 20, (1,), generator=g))
        want, held = _case(g, heads, w, R, pages)
        host = torch.randperm(heads * pages, generator=g).view(heads, pages)
        if i % 2:   # some pages on disk: no host slot, never fetched by a prefetch
            host = torch.where(torch.rand(heads, pages, generator=g) < 0.3, -1, host)
        ahead = torch.rand(heads, R, generator=g) < 0.4
        counts = torch.randint(0, 100, (4,), generator=g)
        lanes, prefetch, given, in_place = [1, 3, 32, 128][i % 4], i % 3 == 0, i % 5 != 0, i % 7 < 3
        cases.append((want, held, pages, host, ahead, counts, prefetch, given))
        numbers = [*want.flatten().tolist(), *held.flatten().tolist(), *host.flatten().tolist(),
                   *ahead.long().flatten().tolist(), *counts.tolist()]
        lines.append(f"{heads} {w} {R} {pages} {lanes} {int(prefetch)} {int(given)} {int(in_place)} "
                     + " ".join(map(str, numbers)))
    done = subprocess.run([str(harness)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout.strip().split("\n")
    assert len(out) == len(cases)
    for (want, held, pages, host, ahead, counts, prefetch, given), line in zip(cases, out):
        got = [[int(x) for x in part.split()] for part in line.split("|")]
        if given:   # flags and counts updated in place
            expect = twins.plan_recall(want, held, pages, host, ahead, counts, prefetch)
        else:       # without host slots the copy reads page ids; flags and counts untouched
            expect = twins.plan_recall(want, held, pages, None, None, None, prefetch)
        for a, b in zip(got, [*expect, ahead.long(), counts]):
            assert a == b.flatten().tolist(), (want.tolist(), held.tolist(), prefetch)
