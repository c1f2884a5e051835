"""The page-ranking kernel's own code, and the e^x, log x and log-sum-exp every kernel shares, compiled for the
host with `nvcc`, give the twins' bits.

`native/rank_pages.cu` keeps its steps in ``__host__ __device__`` functions and `native/kvtier_native.cuh` its
float helpers; a small host program runs them (a block's threads as lanes in turn, the tiles in order) and
every result must equal the twin's, bit for bit: the shares, the ranking and the choice. What only a GPU
shows (shared memory, the barriers, the launch) is `tests/cuda`'s. Skipped without nvcc.
"""

from __future__ import annotations

import subprocess

import numpy as np
import torch

from kvtier.native import ops, twins
from kvtier.recall.codes import encode

from native_host import DTYPE_CODES, HOST_IO, floats, harness_fixture, hex_words, same_bits
from test_native_compile import needs_nvcc

HARNESS = '#include "rank_pages.cu"\n' + HOST_IO + r"""
// stdin, until its end, cases of two kinds (floats as the hex of their bits):
//   x n v[n]: prints the bits of kv_exp(v), kv_log(v) for each, then of kv_logsumexp(v), on one line;
//   t n cap v[n]: prints the bits of kv_tanh(v) and kv_softcap(v, cap) for each, on one line;
//   r T H R D P m pages keep resident tile lanes b_per c_per scaling q[H R D] cand[H m]
//     bounds[pages H 2D] (elements of T: 0 float, 1 half, 2 bf16) codes[pages H P W] resident[H R]:
//     prints chosen | ranked | share bits.
template <typename T>
static void rank(int H, int R, int D, int P, long long m, long long pages, long long keep, int resident, int tile,
                 long long lanes, long long b_per, long long c_per, float scaling) {
    const int W = (D + 3) / 4;
    std::vector<float> q((size_t)H * R * D), res((size_t)H * R), shares((size_t)H * m);
    std::vector<kv_i64> cand((size_t)H * m), ranked((size_t)H * m), chosen((size_t)H * keep);
    for (auto& x : q) x = kv_bits_float(read_u());
    for (auto& x : cand) x = read_i();
    const long long rows = pages * H;
    std::vector<std::vector<T>> b_slabs((rows + b_per - 1) / b_per, std::vector<T>((size_t)b_per * 2 * D));
    std::vector<std::vector<unsigned char>> c_slabs((rows + c_per - 1) / c_per,
                                                     std::vector<unsigned char>((size_t)c_per * P * W));
    for (long long r = 0; r < rows; ++r) {
        for (int j = 0; j < 2 * D; ++j) {
            unsigned v = read_u();
            T* dst = &b_slabs[r / b_per][(r % b_per) * 2 * D + j];
            __builtin_memcpy(dst, &v, sizeof(T));
        }
    }
    for (long long r = 0; r < rows; ++r) {
        for (int j = 0; j < P * W; ++j) c_slabs[r / c_per][(r % c_per) * P * W + j] = (unsigned char)read_u();
    }
    for (auto& x : res) x = kv_bits_float(read_u());
    std::vector<kv_u64> b_addr, c_addr;
    for (auto& s : b_slabs) b_addr.push_back((kv_u64)s.data());
    for (auto& s : c_slabs) c_addr.push_back((kv_u64)s.data());
    kv_rank_smem probe = kv_rank_layout(nullptr, m, tile, R, P, D);
    std::vector<unsigned char> smem((size_t)(reinterpret_cast<unsigned char*>(probe.rank + m) -
                                             static_cast<unsigned char*>(nullptr)) + 16);
    for (int h = 0; h < H; ++h) {   // a block: its threads' share of each step as lanes in turn
        kv_rank_smem s = kv_rank_layout(smem.data(), m, tile, R, P, D);
        const float* qh = &q[(size_t)h * R * D];
        const kv_i64* ch = &cand[(size_t)h * m];
        for (kv_i64 c0 = 0; c0 < m; c0 += tile) {
            const int n = (int)(m - c0 < tile ? m - c0 : tile);
            for (long long l = 0; l < lanes; ++l)
                kv_rank_stage<T>(ch, c0, n, h, H, pages, P, D, b_addr.data(), b_per, c_addr.data(), c_per, s, l,
                                 lanes);
            for (long long l = 0; l < lanes; ++l) kv_rank_logits(qh, n, R, P, D, scaling, s, l, lanes);
            for (long long l = 0; l < lanes; ++l) kv_rank_page_lse(c0, n, R, P, s, l, lanes);
        }
        for (long long l = 0; l < lanes; ++l) kv_rank_totals(m, R, resident ? &res[(size_t)h * R] : nullptr, s, l, lanes);
        for (long long l = 0; l < lanes; ++l) kv_rank_shares(m, R, s, &shares[(size_t)h * m], l, lanes);
        for (long long l = 0; l < lanes; ++l) kv_rank_order(ch, m, s, &ranked[(size_t)h * m], l, lanes);
        for (long long l = 0; l < lanes; ++l) kv_rank_chosen(ch, m, keep, s, &chosen[(size_t)h * keep], l, lanes);
    }
    for (auto x : chosen) printf("%lld ", x);
    printf("| ");
    for (auto x : ranked) printf("%lld ", x);
    printf("| ");
    for (auto x : shares) printf("%x ", kv_float_bits(x));
    printf("\n");
}
int main() {
    char kind[2];
    try {
        while (scanf("%1s", kind) == 1) {
            if (kind[0] == 'x') {
                long long n = read_i();
                std::vector<float> v((size_t)n);
                for (auto& x : v) x = kv_bits_float(read_u());
                for (auto x : v) printf("%x %x ", kv_float_bits(kv_exp(x)), kv_float_bits(kv_log(x)));
                printf("%x\n", kv_float_bits(kv_logsumexp(v.data(), n, 1)));
                continue;
            }
            if (kind[0] == 't') {
                long long n = read_i();
                const float cap = kv_bits_float(read_u());
                for (long long i = 0; i < n; ++i) {
                    const float x = kv_bits_float(read_u());
                    printf("%x %x ", kv_float_bits(kv_tanh(x)), kv_float_bits(kv_softcap(x, cap)));
                }
                printf("\n");
                continue;
            }
            const int T = (int)read_i(), H = (int)read_i(), R = (int)read_i(), D = (int)read_i(), P = (int)read_i();
            const long long m = read_i(), pages = read_i(), keep = read_i();
            const int resident = (int)read_i(), tile = (int)read_i();
            const long long lanes = read_i(), b_per = read_i(), c_per = read_i();
            const float scaling = kv_bits_float(read_u());
            if (T == 0) rank<float>(H, R, D, P, m, pages, keep, resident, tile, lanes, b_per, c_per, scaling);
            if (T == 1) rank<kv_half>(H, R, D, P, m, pages, keep, resident, tile, lanes, b_per, c_per, scaling);
            if (T == 2) rank<kv_bf16>(H, R, D, P, m, pages, keep, resident, tile, lanes, b_per, c_per, scaling);
        }
    } catch (int) {
        return 2;
    }
    return 0;
}
"""
harness = harness_fixture(HARNESS, "rank")


def _run(harness, lines: list[str]) -> list[str]:
    done = subprocess.run([str(harness)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout.strip().split("\n")
    assert len(out) == len(lines)
    return out


SPECIALS = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), 88.72283, 88.7229, -87.33654, -87.3366,
            -103.0, 1e-40, 1.1754942e-38, 3.4e38, 1.4142135, 1.4142137, 0.70710677]


@needs_nvcc
def test_exp_log_and_logsumexp_compiled_for_the_host_give_the_twins_bits(harness):
    g = torch.Generator().manual_seed(1)
    vectors = [torch.tensor(SPECIALS), torch.randn(2000, generator=g) * 30, torch.rand(2000, generator=g) * 1e-3,
               torch.randn(16, generator=g) - 50, torch.tensor([float("-inf")] * 3), torch.tensor([2.0, float("inf")]),
               torch.tensor([float("nan"), float("inf")]), torch.exp(torch.randn(500, generator=g) * 40)]
    vectors = [v.float() for v in vectors]
    out = _run(harness, [f"x {len(v)} {hex_words(v)}" for v in vectors])
    for v, line in zip(vectors, out):
        words = line.split()
        got_exp, got_log, got_lse = floats(words[0:-1:2]), floats(words[1:-1:2]), floats(words[-1:])
        assert same_bits(got_exp, twins.exp(v)), v
        assert same_bits(got_log, twins.log(v)), v
        assert same_bits(got_lse, twins.logsumexp(v[None])), v


@needs_nvcc
def test_tanh_and_the_soft_cap_compiled_for_the_host_give_the_twins_bits(harness):
    g = torch.Generator().manual_seed(2)
    vectors = [torch.tensor(SPECIALS + [0.125, 0.12499999, -0.125, 9.0, -9.5, 1e-30]), torch.randn(3000, generator=g),
               torch.randn(3000, generator=g) * 0.1, torch.randn(3000, generator=g) * 60]
    for cap in (50.0, 1.0, 0.3, 0.0):
        out = _run(harness, [f"t {len(v)} {hex_words(torch.tensor([cap]))} {hex_words(v.float())}" for v in vectors])
        for v, line in zip(vectors, out):
            words = line.split()
            assert same_bits(floats(words[0::2]), twins.tanh(v)), v
            assert same_bits(floats(words[1::2]), twins.softcap(v.float(), cap or None)), (cap, v)


def test_tanh_is_within_five_ulp_of_the_exact_value():
    """Every float32 in [1/8, 1/2), where 1 - e^(-2y) cancels most (4.3 ulp at worst), and samples elsewhere."""
    lo, hi = (torch.tensor([0.125, 0.5]).view(torch.int32)).tolist()
    x = torch.cat([torch.arange(lo, hi, dtype=torch.int32).view(torch.float32), torch.linspace(-12, 12, 400001),
                   torch.linspace(-0.2, 0.2, 100001), torch.randn(100000) * 0.3])
    exact = torch.tanh(x.double())
    ulp = torch.from_numpy(np.spacing(np.abs(exact.float().numpy())).astype(np.float64))
    assert ((twins.tanh(x).double() - exact).abs() / ulp).max() <= 5
    specials = twins.tanh(torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 30.0]))
    assert torch.isnan(specials[0]) and specials[1:3].tolist() == [1.0, -1.0] and specials[4] == 1.0
    assert specials[3] == 0 and torch.signbit(specials[3])


def test_exp_and_log_are_within_two_ulp_of_the_exact_values():
    x = torch.cat([torch.linspace(-87.3, 88.7, 400001), torch.randn(100000) * 5])
    exact = torch.exp(x.double())
    ulp = torch.from_numpy(np.spacing(exact.float().numpy()).astype(np.float64))
    assert ((twins.exp(x).double() - exact).abs() / ulp).max() <= 2
    y = torch.cat([torch.exp(torch.linspace(-87, 88, 400001)), 1 + torch.rand(100000) * 1e-3, torch.tensor([1e-42])])
    exact = torch.log(y.double())
    ulp = torch.from_numpy(np.spacing(np.abs(exact.float().numpy())).astype(np.float64))
    assert ((twins.log(y).double() - exact).abs() / ulp).max() <= 2
    v = torch.randn(64, 40) * 20
    assert torch.allclose(twins.logsumexp(v), torch.logsumexp(v, dim=-1), rtol=1e-6, atol=1e-5)


def _rank_case(g: torch.Generator, dtype: torch.dtype, H: int, R: int, D: int, P: int, m: int, pages: int,
               ties: bool) -> dict:
    keys = torch.randn(pages, H, P, D, generator=g) * 2
    if ties:   # identical pages: equal shares, ranked in short-list order
        keys[1::3] = keys[0]
    hi, lo = keys.amax(dim=2).to(dtype), keys.amin(dim=2).to(dtype)
    codes = encode(keys, lo, hi)   # as the recall index keeps them
    cand = torch.stack([torch.randperm(pages, generator=g)[:m] for _ in range(H)])
    return {"q": torch.randn(H, R, D, generator=g), "cand": cand, "pages": pages,
            "bounds": torch.cat([hi, lo], dim=-1).reshape(pages * H, 2 * D), "codes": codes.reshape(pages * H, P, -1),
            "resident": torch.randn(H, R, generator=g) * 3 + 2}


@needs_nvcc
def test_the_rank_kernels_code_gives_the_twins_shares_ranking_and_choice(harness):
    g = torch.Generator().manual_seed(2)
    cases, lines = [], []
    for i in range(60):
        dtype = list(DTYPE_CODES)[i % 3]
        H, R, D, P = 1 + i % 3, [1, 3, 4, 9][i % 4], [8, 16, 64, 12][i % 4], [4, 16, 8][i % 3]
        pages = 3 + int(torch.randint(0, 40, (1,), generator=g))
        m = 1 + int(torch.randint(0, pages, (1,), generator=g))
        keep = 1 + int(torch.randint(0, m, (1,), generator=g))
        c = _rank_case(g, dtype, H, R, D, P, m, pages, ties=i % 5 == 0)
        resident = c["resident"] if i % 2 else None
        tile = ops.rank_pages_tile(m, R, P, D) if i % 4 else 1 + i % 5
        lanes, b_per, c_per = [1, 7, 32, 256][i % 4], [H, 3 * H, 1000][i % 3], [2, 5 * H, 1000][i % 3]
        scaling = D ** -0.5
        slabs = lambda t, per: (list(torch.cat([t, t.new_zeros(-len(t) % per, *t.shape[1:])]).split(per)), per)
        cases.append((c, resident, keep, scaling, slabs(c["bounds"], b_per), slabs(c["codes"], c_per), P))
        lines.append(" ".join([f"r {DTYPE_CODES[dtype]} {H} {R} {D} {P} {m} {pages} {keep} {int(resident is not None)}",
                               f"{tile} {lanes} {b_per} {c_per} {hex_words(torch.tensor([scaling]).float())}",
                               hex_words(c["q"]), " ".join(map(str, c["cand"].flatten().tolist())), hex_words(c["bounds"]),
                               hex_words(c["codes"].flatten()),
                               hex_words(resident if resident is not None else torch.zeros(H, R))]))
    for (c, resident, keep, scaling, bounds, codes, P), line in zip(cases, _run(harness, lines)):
        chosen, ranked, shares = (part.split() for part in line.split("|"))
        want = twins.rank_pages(c["q"], c["cand"], c["pages"], bounds, codes, P, scaling, keep, resident)
        assert [int(x) for x in chosen] == want[0].flatten().tolist()
        assert [int(x) for x in ranked] == want[1].flatten().tolist()
        assert same_bits(floats(shares), want[2].flatten())


@needs_nvcc
def test_a_candidate_outside_the_index_reads_nothing_and_poisons_only_its_head(harness):
    g = torch.Generator().manual_seed(3)
    c = _rank_case(g, torch.float32, 2, 2, 16, 4, 5, 8, ties=False)
    c["cand"][1, 2] = 8   # one past the last page
    line = " ".join(["r 0 2 2 16 4 5 8 3 0 5 32 1000 1000", hex_words(torch.tensor([0.25])), hex_words(c["q"]),
                     " ".join(map(str, c["cand"].flatten().tolist())), hex_words(c["bounds"]), hex_words(c["codes"].flatten()),
                     hex_words(torch.zeros(2, 2))])
    chosen, ranked, shares = (part.split() for part in _run(harness, [line])[0].split("|"))
    want = twins.rank_pages(c["q"], c["cand"], 8, ([c["bounds"]], 16), ([c["codes"]], 16), 4, 0.25, 3)
    assert same_bits(floats(shares), want[2].flatten())
    assert not want[2][0].isnan().any() and want[2][1].isnan().all()
    assert [int(x) for x in ranked] == want[1].flatten().tolist()
