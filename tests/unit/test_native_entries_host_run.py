"""The device pool's entry kernels' own code, compiled for the host with `nvcc`, gives the twins' bytes.

`native/pack_entries.cu` keeps a warp's share of one entry in ``__host__ __device__`` functions
(`kv_pack_entry`, `kv_move_entry`). A small host program runs them over pools kept in host memory, entries in
reverse order and a warp's lanes in turn, and each result must equal `twins.pack_entries` /
`twins.move_entries` byte for byte: rows that take the 16-byte path (keys, values) and rows that do not
(positions, scores), one slab and several. What only a GPU shows (the launch, the grid's stride) is
`tests/cuda`'s; skipped without nvcc.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from kvtier.native import twins

from native_host import harness_fixture
from test_native_compile import needs_nvcc

HARNESS = r"""
#include "pack_entries.cu"
#include <cstdio>
#include <vector>
// Cases from stdin until its end, each: op (0 pack, 1 move) heads slab_tokens slabs m row_bytes, the slabs'
// bytes, then idx (pack) or src and dst (move), [heads * m] each; one line per case: the packed bytes (pack)
// or every slab's bytes after the moves (move).
static long long next() {
    long long v;
    if (scanf("%lld", &v) != 1) throw 1;
    return v;
}
int main() {
    long long op;
    while (scanf("%lld", &op) == 1) {
        const long long heads = next(), S = next(), n = next(), m = next(), rb = next();
        // 16-byte aligned slabs, as the device's are (the copy's fast path checks the addresses)
        std::vector<std::vector<kv_vec16>> slabs(n, std::vector<kv_vec16>((heads * S * rb + 15) / 16));
        std::vector<kv_u64> table(n);
        for (long long s = 0; s < n; ++s) {
            char* bytes = reinterpret_cast<char*>(slabs[s].data());
            for (long long i = 0; i < heads * S * rb; ++i) bytes[i] = (char)next();
            table[s] = reinterpret_cast<kv_u64>(bytes);
        }
        std::vector<kv_i64> a(heads * m), b(heads * m);
        for (auto& x : a) x = next();
        if (op == 1) for (auto& x : b) x = next();
        std::vector<kv_vec16> out((heads * m * rb + 15) / 16 + 1);
        for (long long e = heads * m - 1; e >= 0; --e) {   // entries in reverse, a warp's lanes in turn
            for (long long lane = 0; lane < 32; ++lane) {
                if (op == 0) {
                    kv_pack_entry(table.data(), S, a.data(), m, reinterpret_cast<char*>(out.data()), rb, e, lane, 32);
                } else {
                    kv_move_entry(table.data(), S, a.data(), b.data(), m, rb, e, lane, 32);
                }
            }
        }
        if (op == 0) {
            const unsigned char* bytes = reinterpret_cast<const unsigned char*>(out.data());
            for (long long i = 0; i < heads * m * rb; ++i) printf("%d ", bytes[i]);
        } else {
            for (long long s = 0; s < n; ++s) {
                const unsigned char* bytes = reinterpret_cast<const unsigned char*>(slabs[s].data());
                for (long long i = 0; i < heads * S * rb; ++i) printf("%d ", bytes[i]);
            }
        }
        printf("\n");
    }
    return 0;
}
"""


harness = harness_fixture(HARNESS, "entries")


def _run(harness, cases: list[str]) -> list[list[int]]:
    done = subprocess.run([str(harness)], input="\n".join(cases) + "\n", capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout.strip().split("\n")
    assert len(out) == len(cases)
    return [[int(x) for x in line.split()] for line in out]


def _pool(g: torch.Generator, heads: int, S: int, n: int, rb: int) -> list[torch.Tensor]:
    """A pool's slabs as bytes ``[1, heads, S, rb]``: each entry's row is its bytes."""
    return [torch.randint(0, 256, (1, heads, S, rb), generator=g, dtype=torch.uint8) for _ in range(n)]


def _head(pool: list[torch.Tensor], heads: int, m: int) -> str:
    heads_, S, rb = pool[0].shape[1], pool[0].shape[2], pool[0].shape[3]
    return f"{heads_} {S} {len(pool)} {m} {rb} " + " ".join(map(str, torch.cat([s.flatten() for s in pool]).tolist()))


@needs_nvcc
@pytest.mark.parametrize("rb", [256, 8, 4])   # key and value rows (16-byte words); positions; scores
def test_pack_and_move_entry_code_gives_the_twins_bytes(harness, rb):
    g = torch.Generator().manual_seed(rb)
    cases, want = [], []
    for i in range(40):
        heads, S, n = 1 + i % 3, [16, 5, 64][i % 3], 1 + i % 4
        count = S * n - (i % S)
        pool = _pool(g, heads, S, n, rb)
        m = min(count // 2, 1 + i % 9)
        idx = torch.stack([torch.randperm(count, generator=g)[:m] for _ in range(heads)])
        cases.append(f"0 {_head(pool, heads, m)} " + " ".join(map(str, idx.flatten().tolist())))
        want.append(twins.pack_entries(pool, idx).flatten().tolist())
        # a demotion's moves: sources from the tail, destinations below it, some lanes onto themselves
        tail = torch.stack([torch.randperm(m, generator=g) + count - m for _ in range(heads)])
        holes = torch.stack([torch.randperm(count - m, generator=g)[:m] for _ in range(heads)])
        dst = torch.where(torch.rand(heads, m, generator=g) < 0.7, holes, tail)
        cases.append(f"1 {_head(pool, heads, m)} " + " ".join(map(str, [*tail.flatten().tolist(),
                                                                       *dst.flatten().tolist()])))
        moved = [s.clone() for s in pool]
        twins.move_entries(moved, tail, dst)
        want.append(torch.cat([s.flatten() for s in moved]).tolist())
    got = _run(harness, cases)
    for k, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"case {k} ({'pack' if k % 2 == 0 else 'move'})"
