"""What the host-run tests of the native kernels share: their harness built for the host, and the float bits
they trade with it as hexadecimal words (exact, NaN payloads aside)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_native_compile import NVCC, host_harness

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}   # how a harness is told a storage dtype

# What every harness reads and prints with, after the kernel source it includes (which brings
# kvtier_native.cuh): integers, hex words of float bits or of cache elements, read from stdin until its end
# (a short read throws, and main returns 2).
HOST_IO = r"""
#include <cstdio>
#include <vector>
inline unsigned read_u() {
    unsigned v;
    if (scanf("%x", &v) != 1) throw 1;
    return v;
}
inline long long read_i() {
    long long v;
    if (scanf("%lld", &v) != 1) throw 1;
    return v;
}
template <typename T>
inline std::vector<T> read_elems(size_t n) {
    std::vector<T> out(n);
    for (auto& x : out) {
        unsigned v = read_u();
        __builtin_memcpy(&x, &v, sizeof(T));
    }
    return out;
}
inline std::vector<float> read_floats(size_t n) {
    std::vector<float> out(n);
    for (auto& x : out) x = kv_bits_float(read_u());
    return out;
}
inline void print_bits(const std::vector<float>& v) {
    for (auto x : v) printf("%x ", kv_float_bits(x));
}
"""


def harness_fixture(text: str, tag: str):
    """A module-scoped fixture giving the harness `text` built for the host (skipped without nvcc)."""
    @pytest.fixture(scope="module")
    def harness(tmp_path_factory):
        if NVCC is None:
            pytest.skip("nvcc is not installed")
        return host_harness(text, tmp_path_factory.mktemp(tag))
    return harness


def hex_words(t: torch.Tensor) -> str:
    """A tensor's elements as hex words of their bits: float32 by its 32 bits, half and bfloat16 by their 16,
    integers by their value."""
    t = t.detach().contiguous()
    if t.dtype == torch.float32:
        bits = t.view(torch.int32).numpy().astype(np.uint32)
    elif t.dtype in (torch.float16, torch.bfloat16):
        bits = t.view(torch.int16).numpy().astype(np.uint16)
    else:
        bits = t.numpy().astype(np.uint32)
    return " ".join(f"{int(b):x}" for b in bits.reshape(-1))


def floats(words: list[str]) -> torch.Tensor:
    """Hex words of float32 bits back as a float32 tensor."""
    return torch.from_numpy(np.array([int(w, 16) for w in words], dtype=np.uint32).view(np.float32))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, any NaN standing for any other (a NaN's payload is the hardware's choice)."""
    a, b = a.float().reshape(-1), b.float().reshape(-1)
    return bool(torch.equal(torch.isnan(a), torch.isnan(b))
                and torch.equal(a.nan_to_num(0.0).view(torch.int32), b.nan_to_num(0.0).view(torch.int32)))
