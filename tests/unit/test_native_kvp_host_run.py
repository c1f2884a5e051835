"""The KVP scoring kernel's own code, compiled for the host with `nvcc`, gives the twin's scores bit for bit,
and the twin scores as the scorer's networks do up to float rounding.

`native/kvp_score.cu` keeps its steps in ``__host__ __device__`` functions; a small host program runs them (a
block's threads as lanes in turn) over the shipped KVP weights and random entries. What only a GPU shows
(shared memory, the barriers, the launch) is `tests/cuda`'s. The harness is skipped without nvcc.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

from kvtier import native
from kvtier.native import twins
from kvtier.scoring.features import position_features
from kvtier.scoring.kvp import KVPScorer

from native_host import DTYPE_CODES, harness_fixture, hex_words
from test_native_compile import needs_nvcc

HARNESS = r"""
#include "kvp_score.cu"
#include <cstdio>
#include <vector>
// stdin, until its end, cases: T H D F hidden agents first lanes dtype (0 float, 1 half, 2 bf16), then as hex
// words keys [H T D] and values [H T D] (elements of the dtype), positions [T F], mean, std [agents d_in],
// w1 [agents d_in hidden], b1 [agents hidden], w2 [agents hidden hidden], b2 [agents hidden], w3 [agents
// hidden], b3 [agents] (float32 bits); prints the scores [H T] as float bits, one case a line.
static void fill(std::vector<float>& v) {
    for (auto& x : v) {
        unsigned b;
        if (scanf("%x", &b) != 1) throw 1;
        x = kv_bits_float(b);
    }
}
template <typename T>
static void run(int Tn, int H, int D, int F, int hidden, int agents, int first, int lanes) {
    const int d_in = 2 * D + F;
    std::vector<T> keys((size_t)H * Tn * D), values(keys.size());
    for (auto* v : {&keys, &values}) {
        for (auto& x : *v) {
            unsigned b;
            if (scanf("%x", &b) != 1) throw 1;
            __builtin_memcpy(&x, &b, sizeof(T));
        }
    }
    std::vector<float> pos((size_t)Tn * F), mean((size_t)agents * d_in), stdv(mean.size()),
        w1((size_t)agents * d_in * hidden), b1((size_t)agents * hidden), w2((size_t)agents * hidden * hidden),
        b2(b1.size()), w3(b1.size()), b3((size_t)agents), z((size_t)d_in), h1((size_t)hidden), h2((size_t)hidden);
    for (auto* v : {&pos, &mean, &stdv, &w1, &b1, &w2, &b2, &w3, &b3}) fill(*v);
    for (int h = 0; h < H; ++h) {
        for (int t = 0; t < Tn; ++t) {   // a block: its threads' share of each step as lanes in turn
            const long long a = first + h, at = ((long long)h * Tn + t) * D;
            for (int l = 0; l < lanes; ++l)
                kv_kvp_features<T>(&keys[at], &values[at], &pos[(size_t)t * F], D, F, &mean[a * d_in], &stdv[a * d_in],
                                   z.data(), l, lanes);
            for (int l = 0; l < lanes; ++l)
                kv_kvp_hidden(z.data(), d_in, &w1[a * d_in * hidden], &b1[a * hidden], hidden, h1.data(), l, lanes);
            for (int l = 0; l < lanes; ++l)
                kv_kvp_hidden(h1.data(), hidden, &w2[a * hidden * hidden], &b2[a * hidden], hidden, h2.data(), l,
                              lanes);
            printf("%x ", kv_float_bits(kv_kvp_out(h2.data(), hidden, &w3[a * hidden], b3[a])));
        }
    }
    printf("\n");
}
int main() {
    int Tn, H, D, F, hidden, agents, first, lanes, dtype;
    try {
        while (scanf("%d %d %d %d %d %d %d %d %d", &Tn, &H, &D, &F, &hidden, &agents, &first, &lanes, &dtype) == 9) {
            if (dtype == 0) run<float>(Tn, H, D, F, hidden, agents, first, lanes);
            if (dtype == 1) run<kv_half>(Tn, H, D, F, hidden, agents, first, lanes);
            if (dtype == 2) run<kv_bf16>(Tn, H, D, F, hidden, agents, first, lanes);
        }
    } catch (int) {
        return 2;
    }
    return 0;
}
"""
harness = harness_fixture(HARNESS, "kvp")


def _entries(g: torch.Generator, H: int, T: int, D: int, dtype: torch.dtype, start: int):
    keys = (torch.randn(H, T, D, generator=g) * 2).to(dtype)
    values = torch.randn(H, T, D, generator=g).to(dtype)
    return keys, values, position_features(torch.arange(start, start + T))


@needs_nvcc
def test_the_kvp_kernels_code_gives_the_twins_scores(harness):
    scorer = KVPScorer()
    layers, H, D = scorer.shape
    w = scorer.agents.weights()
    agents, hidden = w.w1.shape[0], w.w1.shape[2]
    g = torch.Generator().manual_seed(0)
    cases, lines = [], []
    for i, (dtype, T, layer, lanes) in enumerate([(torch.bfloat16, 1, 0, 64), (torch.float16, 3, layers - 1, 32),
                                                   (torch.float32, 2, 5, 1), (torch.bfloat16, 4, 11, 7)]):
        keys, values, pos = _entries(g, H, T, D, dtype, start=17 + 1000 * i)
        cases.append(twins.kvp_score(keys, values, pos, w, layer * H))
        lines.append(" ".join([f"{T} {H} {D} {pos.shape[1]} {hidden} {agents} {layer * H} {lanes} {DTYPE_CODES[dtype]}",
                               hex_words(keys), hex_words(values), hex_words(pos), *(hex_words(t) for t in w)]))
    done = subprocess.run([str(harness)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout.strip().split("\n")
    assert len(out) == len(cases)
    for want, line in zip(cases, out):
        got = torch.from_numpy(np.array([int(x, 16) for x in line.split()], dtype=np.uint32).view(np.float32))
        assert torch.equal(got.view(torch.int32), want.reshape(-1).contiguous().view(torch.int32))


def test_kernel_scores_are_the_networks_scores_up_to_rounding():
    scorer = KVPScorer()
    layers, H, D = scorer.shape
    g = torch.Generator().manual_seed(1)
    for layer in (0, layers // 2, layers - 1):
        keys, values, _ = _entries(g, H, 6, D, torch.bfloat16, start=300 * layer)
        positions = torch.arange(300 * layer, 300 * layer + 6)
        scorer.native_score = False
        plain = scorer.score(keys[None], values[None], positions, layer)
        native.reset_stats()
        scorer.native_score = True
        got = scorer.score(keys[None], values[None], positions, layer)
        assert native.backend()["ops"]["kvp_score"]["twin"] == 1   # no CUDA here: the twin stands for the kernel
        torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-4)


def test_kvp_score_refuses_bad_arguments_naming_them():
    w = KVPScorer().agents.weights()
    agents, d_in, _ = w.w1.shape
    D = (d_in - 8) // 2
    k = torch.randn(2, 1, D)
    with pytest.raises(ValueError, match=r"position features \[1, 5\]"):
        native.kvp_score(k, k, torch.zeros(1, 5), w, 0)
    with pytest.raises(ValueError, match=f"first={agents}; allowed: 0 to {agents - 2}"):
        native.kvp_score(k, k, torch.zeros(1, 8), w, agents)
    with pytest.raises(ValueError, match="keys"):
        native.kvp_score(k, k.half(), torch.zeros(1, 8), w, 0)
