"""The attention-merge kernel's own code, compiled for the host with `nvcc`, gives the twin's bits, and the merge
through it is the attention over the union of the parts' keys.

`native/merge_parts.cu` computes each element in a ``__host__ __device__`` function; a small host program runs
it over every element of random parts (strided, with empty sets among them) and must give `twins.merge_parts`'
bits. The launch itself is `tests/cuda`'s. The harness is skipped without nvcc.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

from kvtier import native
from kvtier.engine.attention import attend_with_lse, merge_with_lse
from kvtier.native import twins

from native_host import harness_fixture, hex_words, same_bits
from test_native_compile import needs_nvcc

HARNESS = r"""
#include "merge_parts.cu"
#include <cstdio>
#include <vector>
// stdin, until its end, cases: K H R D, then per part (as float32 hex bits) out [H R D] and lse [H R]; every
// part is stored with a padded row (stride D + 3) and lse rows of stride R + 1, as strided views are.
// Prints out [H R D] then lse [H R] bits, one case a line.
int main() {
    int K, H, R, D;
    while (scanf("%d %d %d %d", &K, &H, &R, &D) == 4) {
        std::vector<std::vector<float>> outs(K), lses(K);
        kv_part parts[KV_MERGE_MAX];
        for (int i = 0; i < K; ++i) {
            outs[i].assign((size_t)H * R * (D + 3), 0.0f);
            lses[i].assign((size_t)H * (R + 1), 0.0f);
            for (int h = 0; h < H; ++h)
                for (int r = 0; r < R; ++r)
                    for (int d = 0; d < D; ++d) {
                        unsigned b;
                        if (scanf("%x", &b) != 1) return 2;
                        outs[i][((size_t)h * R + r) * (D + 3) + d] = kv_bits_float(b);
                    }
            for (int h = 0; h < H; ++h)
                for (int r = 0; r < R; ++r) {
                    unsigned b;
                    if (scanf("%x", &b) != 1) return 2;
                    lses[i][(size_t)h * (R + 1) + r] = kv_bits_float(b);
                }
            parts[i] = {outs[i].data(), (kv_i64)R * (D + 3), D + 3, lses[i].data(), R + 1, 1};
        }
        std::vector<float> out((size_t)H * R * D), lse((size_t)H * R);
        for (kv_i64 e = 0; e < (kv_i64)out.size(); ++e) kv_merge_element(parts, K, e, R, D, out.data(), lse.data());
        for (auto x : out) printf("%x ", kv_float_bits(x));
        for (auto x : lse) printf("%x ", kv_float_bits(x));
        printf("\n");
    }
    return 0;
}
"""


harness = harness_fixture(HARNESS, "merge")


def _parts(g: torch.Generator, K: int, H: int, R: int, D: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    parts = []
    for i in range(K):
        lse = torch.randn(H, R, generator=g) * 4
        if i == 1:   # a set with no keys
            lse = torch.full((H, R), float("-inf"))
        parts.append((torch.randn(H, R, D, generator=g), lse))
    return parts


@needs_nvcc
def test_the_merge_kernels_code_gives_the_twins_bits(harness):
    g = torch.Generator().manual_seed(0)
    cases = [_parts(g, K, H, R, D) for K, H, R, D in [(1, 2, 3, 8), (2, 3, 4, 16), (3, 1, 1, 64), (4, 8, 4, 128)]]
    cases.append([(torch.randn(2, 2, 4, generator=g), torch.full((2, 2), float("-inf"))) for _ in range(2)])
    lines = [f"{len(c)} {c[0][0].shape[0]} {c[0][0].shape[1]} {c[0][0].shape[2]} " +
             " ".join(hex_words(o) + " " + hex_words(lse) for o, lse in c) for c in cases]
    done = subprocess.run([str(harness)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for parts, line in zip(cases, done.stdout.strip().split("\n")):
        H, R, D = parts[0][0].shape
        bits = np.array([int(x, 16) for x in line.split()], dtype=np.uint32).view(np.float32)
        out, lse = twins.merge_parts(parts)
        assert same_bits(torch.from_numpy(bits[:H * R * D].copy()), out.reshape(-1))
        assert same_bits(torch.from_numpy(bits[H * R * D:].copy()), lse.reshape(-1))


@pytest.mark.parametrize("K", [2, 4, 5, 9])
def test_merging_through_the_kernel_is_attention_over_the_union(K):
    """Parts made by attention over slices of one key set, merged a group at a time: the attention over the
    whole set, as the torch merge gives it, up to rounding."""
    g = torch.Generator().manual_seed(K)
    q = torch.randn(1, 2, 3, 32, generator=g)
    k, v = torch.randn(1, 2, 40 * K, 32, generator=g), torch.randn(1, 2, 40 * K, 32, generator=g)
    parts = [attend_with_lse(q, k[:, :, i::K], v[:, :, i::K], 0.2) for i in range(K)]
    parts.append((torch.zeros(1, 2, 3, 32), torch.full((1, 2, 3), float("-inf"))))   # nothing to attend
    whole = attend_with_lse(q, k, v, 0.2)
    native.reset_stats()
    out, lse = merge_with_lse(parts, kernels=True)
    # the first launch takes four parts, each later one the result so far and three more
    assert native.backend()["ops"]["merge_parts"]["twin"] == 1 + -(-(K + 1 - 4) // 3)
    torch.testing.assert_close(out, whole[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, whole[1], rtol=1e-5, atol=1e-5)
    plain = merge_with_lse(parts)
    torch.testing.assert_close(out, plain[0], rtol=1e-6, atol=1e-6)


def test_merge_parts_refuses_parts_that_differ_naming_them():
    with pytest.raises(ValueError, match="no parts"):
        native.merge_parts([])
    with pytest.raises(ValueError, match=r"\[2, 3, 4\] and \[2, 3\] torch.float32"):
        native.merge_parts([(torch.zeros(2, 3, 4), torch.zeros(2, 3)), (torch.zeros(2, 3, 5), torch.zeros(2, 3))])
