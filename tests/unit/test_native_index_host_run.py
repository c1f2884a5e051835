"""The recall index kernel's own code, compiled for the host with `nvcc`, gives the twin's bounds and codes bit
for bit; and the twin indexes pages as the recall index's torch functions do (`page_bounds`, `round_outward`,
`encode`), which it replaced on the demotion path.

`native/index_pages.cu` keeps a thread's work (the four channels of one code byte of one page) in a
``__host__ __device__`` function; a small host program runs it for every byte of every page, in reverse order,
over a bounds storage of several slabs. What only a GPU shows (the launch, the grid's stride) is `tests/cuda`'s.
The harness is skipped without nvcc.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from kvtier.native import twins
from kvtier.recall.bounds import page_bounds, round_outward
from kvtier.recall.codes import encode

from native_host import DTYPE_CODES, harness_fixture, hex_words, same_bits
from test_native_compile import needs_nvcc

HARNESS = r"""
#include "index_pages.cu"
#include <cstdio>
#include <vector>
// stdin, until its end, cases: H m P D slabs rows_per_slab first dtype (0 float, 1 half, 2 bf16), then the keys
// [H m P D] as hex words of their elements; prints every row of the bounds storage (hex words of its elements,
// rows never written left as 0xffff / 0xffffffff), then the codes [m H P ceil(D/4)] as bytes, one case a line.
template <typename T>
static void run(long long H, long long m, int P, int D, long long slabs, long long rows_per_slab, long long first) {
    std::vector<T> keys((size_t)(H * m * P * D));
    for (auto& x : keys) {
        unsigned b;
        if (scanf("%x", &b) != 1) throw 1;
        __builtin_memcpy(&x, &b, sizeof(T));
    }
    std::vector<std::vector<T>> storage(slabs, std::vector<T>((size_t)(rows_per_slab * 2 * D)));
    std::vector<kv_u64> table(slabs);
    for (long long s = 0; s < slabs; ++s) {
        __builtin_memset(storage[s].data(), 0xff, storage[s].size() * sizeof(T));
        table[s] = reinterpret_cast<kv_u64>(storage[s].data());
    }
    const int width = (D + 3) / 4;
    std::vector<unsigned char> codes((size_t)(m * H * P * width), 0xee);
    for (long long g = m * H * width - 1; g >= 0; --g) {
        kv_index_byte<T>(keys.data(), m * P * D, (long long)P * D, D, H, P, D, table.data(), rows_per_slab, first,
                         codes.data(), g / width, (int)(g % width));
    }
    for (long long s = 0; s < slabs; ++s) {
        for (const T& x : storage[s]) {
            unsigned b = 0;
            __builtin_memcpy(&b, &x, sizeof(T));
            printf("%x ", b);
        }
    }
    printf("| ");
    for (unsigned char c : codes) printf("%d ", c);
    printf("\n");
}
int main() {
    long long H, m, slabs, rows_per_slab, first;
    int P, D, dtype;
    try {
        while (scanf("%lld %lld %d %d %lld %lld %lld %d", &H, &m, &P, &D, &slabs, &rows_per_slab, &first,
                     &dtype) == 8) {
            if (dtype == 0) run<float>(H, m, P, D, slabs, rows_per_slab, first);
            if (dtype == 1) run<kv_half>(H, m, P, D, slabs, rows_per_slab, first);
            if (dtype == 2) run<kv_bf16>(H, m, P, D, slabs, rows_per_slab, first);
        }
    } catch (int) {
        return 2;
    }
    return 0;
}
"""

harness = harness_fixture(HARNESS, "index")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _keys(g: torch.Generator, H: int, m: int, P: int, D: int, dtype: torch.dtype, special: bool) -> torch.Tensor:
    """Random keys with ties, zeros of both signs and runs of equal values; with `special`, some inf and NaN."""
    k = torch.randn(H, m, P, D, generator=g) * 3
    k = torch.where(torch.rand(H, m, P, D, generator=g) < 0.15, torch.round(k), k)   # ties between entries
    zeros = torch.rand(H, m, P, D, generator=g)
    k = torch.where(zeros < 0.05, torch.zeros(()), torch.where(zeros < 0.1, -torch.zeros(()), k))
    k[:, :, :, :1] = k[:, :, :1, :1]    # a channel equal over the page: step at its floor
    if special:
        pick = torch.rand(H, m, P, D, generator=g)
        k = torch.where(pick < 0.01, torch.tensor(float("nan")), k)
        k = torch.where((pick > 0.01) & (pick < 0.02), torch.tensor(float("inf")), k)
        k = torch.where((pick > 0.02) & (pick < 0.03), torch.tensor(float("-inf")), k)
    return k.to(dtype)


def _storage(slabs: int, rows_per_slab: int, D: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.full((rows_per_slab, 2 * D), -1, dtype=torch.int16 if dtype != torch.float32 else torch.int32)
            .view(dtype) for _ in range(slabs)]


@needs_nvcc
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_index_kernel_code_gives_the_twins_bits(harness, dtype):
    g = torch.Generator().manual_seed(DTYPE_CODES[dtype])
    cases, want = [], []
    for i in range(24):
        H, m, P = 1 + i % 3, 1 + i % 5, [16, 4, 1, 7][i % 4]
        D = [16, 12, 6, 64, 3][i % 5]
        rows_per_slab = [4, 7, 64][i % 3]
        first = i % 5
        slabs = -(-(first + m * H) // rows_per_slab) + i % 2
        keys = _keys(g, H, m, P, D, dtype, special=i % 3 == 2)
        storage = _storage(slabs, rows_per_slab, D, dtype)
        codes = twins.index_pages(keys, storage, rows_per_slab, first)
        cases.append(f"{H} {m} {P} {D} {slabs} {rows_per_slab} {first} {DTYPE_CODES[dtype]} {hex_words(keys)}")
        want.append((storage, codes))
    done = subprocess.run([str(harness)], input="\n".join(cases) + "\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().split("\n")
    assert len(lines) == len(cases)
    for line, (storage, codes) in zip(lines, want):
        rows_part, codes_part = line.split("|")
        words = [int(w, 16) for w in rows_part.split()]
        bits = torch.tensor(words, dtype=torch.int64)
        got = (bits.to(torch.int32).view(torch.float32) if dtype == torch.float32
               else bits.to(torch.int16).view(dtype))
        assert same_bits(got, torch.cat([s.reshape(-1) for s in storage]))
        assert torch.equal(torch.tensor([int(c) for c in codes_part.split()], dtype=torch.uint8), codes.reshape(-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("P, D", [(16, 64), (16, 6), (1, 8), (5, 3)])
def test_index_twin_indexes_as_the_recall_functions(dtype, P, D):
    """The bounds are `round_outward(page_bounds(...))`'s (equal values; the sign of a zero may differ) and the
    codes `encode`'s, for finite keys; rows go where the index keeps them (page-major, then head)."""
    g = torch.Generator().manual_seed(P * 100 + D)
    H, m, rows_per_slab, first = 3, 9, 10, 4
    keys = _keys(g, H, m, P, D, dtype, special=False)
    storage = _storage(4, rows_per_slab, D, dtype)
    codes = twins.index_pages(keys, storage, rows_per_slab, first)
    lo, hi = round_outward(*page_bounds(keys, torch.full((H, m), P)), dtype)
    want_rows = torch.cat([hi, lo], dim=-1).transpose(0, 1).reshape(m * H, 2 * D)
    rows = torch.cat(storage)[first:first + m * H]
    assert torch.equal(rows.float(), want_rows.float())
    before = torch.cat(storage)[:first]
    assert torch.equal(before.view(torch.int32 if dtype == torch.float32 else torch.int16),
                       torch.full(before.shape, -1, dtype=torch.int32 if dtype == torch.float32 else torch.int16))
    assert torch.equal(codes, encode(keys, lo, hi).transpose(0, 1).reshape(m * H, P, -1))
    assert codes.shape == (m * H, P, -(-D // 4))


def test_index_twin_codes_nan_keys_as_zero_and_bounds_as_nan():
    keys = torch.randn(1, 2, 4, 8)
    keys[0, 0, 2, 3] = float("nan")
    storage = [torch.zeros(8, 16)]
    codes = twins.index_pages(keys, storage, 8, 0)
    assert torch.isnan(storage[0][0, 3]) and torch.isnan(storage[0][0, 8 + 3])   # hi and lo of that channel
    assert not torch.isnan(storage[0][1]).any()
    assert int(codes[0, 2, 0]) >> 6 == 0       # channel 3 of entry 2: the code of NaN is 0
