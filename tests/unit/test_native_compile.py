"""The CUDA sources compile for the H200 (sm_90) wherever a compiler is installed, with every warning an error.

`nvcc` checks the sources as they sit in ``native/`` (headers by include path) and as the loader hands them
to NVRTC (headers inlined); where the NVRTC library itself is found, the loader's text goes through it too,
with the options the loader gives cupy. Each is skipped, with the reason, where its compiler is absent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvtier.native import loader

SOURCES = loader.sources()
ARCH = "sm_90"
KERNELS = {
    "gather_pages": ["kvtier_gather_pages"],
    "scatter_pages": ["kvtier_scatter_pages"],
    "index_pages": ["kvtier_index_pages_f32", "kvtier_index_pages_f16", "kvtier_index_pages_bf16"],
    "recall_pages": ["kvtier_recall_pages"],
    "plan_recall": ["kvtier_plan_recall"],
    "pack_entries": ["kvtier_pack_entries", "kvtier_move_entries"],
    "page_select": ["kvtier_page_upper_bounds_f32", "kvtier_page_upper_bounds_f16",
                    "kvtier_page_upper_bounds_bf16", "kvtier_code_logits"],
    "rank_pages": ["kvtier_rank_pages_f32", "kvtier_rank_pages_f16", "kvtier_rank_pages_bf16"],
    "kvp_score": ["kvtier_kvp_score_f32", "kvtier_kvp_score_f16", "kvtier_kvp_score_bf16"],
    "merge_parts": ["kvtier_merge_parts"],
    "attend_slabs": ["kvtier_attend_chunks_f32", "kvtier_attend_chunks_f16", "kvtier_attend_chunks_bf16",
                     "kvtier_attend_chunks_wide_f32", "kvtier_attend_chunks_wide_f16", "kvtier_attend_chunks_wide_bf16",
                     "kvtier_attend_combine"],
}
# float arithmetic the twins follow op by op
FLOAT_SOURCES = ("index_pages", "page_select", "rank_pages", "kvp_score", "merge_parts", "attend_slabs")


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if not found and home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            found = os.path.join(home, "bin", "nvcc")
    return found


NVCC = _nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed (not on PATH, no CUDA_HOME)")


def host_harness(text: str, where: Path) -> Path:
    """A C++ program that includes kernel sources (their ``__host__ __device__`` code), built for the host with
    nvcc: the host's float operations, like the device's _rn intrinsics, are never contracted into FMAs."""
    (where / "harness.cu").write_text(text)
    exe = where / "harness"
    done = subprocess.run([NVCC, *loader.OPTIONS, "-Xcompiler", "-ffp-contract=off", "-I", str(loader.SOURCE_DIR),
                           "-o", str(exe), str(where / "harness.cu")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return exe


def _entries(ptx: str) -> set[str]:
    return set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx))


def test_every_source_has_its_kernels_listed():
    assert {p.stem for p in SOURCES} == set(KERNELS)


@needs_nvcc
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
@pytest.mark.parametrize("as_loaded", [False, True], ids=["as-shipped", "as-loaded"])
def test_source_compiles_with_nvcc_without_warnings(src: Path, as_loaded: bool, tmp_path):
    if as_loaded:   # the text NVRTC gets: headers inlined, no include path
        path = tmp_path / src.name
        path.write_text(loader.source(src.stem))
        include = []
    else:
        path, include = src, ["-I", str(loader.SOURCE_DIR)]
    common = [NVCC, f"-arch={ARCH}", *loader.OPTIONS, "-Werror", "all-warnings", *include, str(path)]
    ptx = tmp_path / f"{src.stem}.ptx"
    # ptxas: spilled registers or local memory in a copy or a bound would be a silent slowdown
    cubin_cmd = [*common, "--cubin", "-Xptxas", "--warn-on-spills,--warn-on-local-memory-usage,--warning-as-error",
                 "-o", str(tmp_path / f"{src.stem}.cubin")]
    for cmd in ([*common, "--ptx", "-o", str(ptx)], cubin_cmd):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"
        assert "warning" not in (done.stdout + done.stderr).lower(), done.stdout + done.stderr
    text = ptx.read_text()
    assert _entries(text) == set(KERNELS[src.stem])
    if src.stem in FLOAT_SOURCES:
        # products and sums round on their own (the twins' order): no fused multiply-add may appear
        assert not re.search(r"\bfma\.rn\.f32\b", text)


def _nvrtc() -> ctypes.CDLL | None:
    """The NVRTC library: from the nvidia-cuda-nvrtc wheels cupy uses, the loader path, or CUDA_HOME."""
    candidates = []
    try:   # the nvidia-cuda-nvrtc wheels (the test extra; cupy's and CUDA builds of torch): nvidia/<part>/lib
        import nvidia
        for root in nvidia.__path__:
            candidates += sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    name = ctypes.util.find_library("nvrtc")
    if name:
        candidates.append(name)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home:
            candidates += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    for c in candidates:
        if "builtins" in c or ".alt." in c:
            continue
        try:
            return ctypes.CDLL(c)
        except OSError:
            continue
    return None


NVRTC = _nvrtc()


@pytest.mark.skipif(NVRTC is None, reason="the NVRTC library is not installed (no nvidia-cuda-nvrtc, no CUDA_HOME)")
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_source_compiles_with_nvrtc_as_the_loader_gives_it(src: Path):
    lib = NVRTC
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), loader.source(src.stem).encode(), src.name.encode(),
                                  0, None, None) == 0
    try:
        # as the loader builds through cupy: its options, the target and the execution-space default cupy adds
        opts = [*loader.OPTIONS, f"-arch=compute_{ARCH[3:]}", "--device-as-default-execution-space"]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        result = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        message = log.value.decode(errors="replace")
        assert result == 0, message
        assert "warning" not in message.lower(), message
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        text = ptx.value.decode()
        assert _entries(text) == set(KERNELS[src.stem])
        # subnormals kept, as the twins keep them (cupy's own build would flush them: `-ftz=true`)
        assert not re.search(r"\.ftz\b", text)
        if src.stem in FLOAT_SOURCES:
            assert not re.search(r"\bfma\.rn\.f32\b", text)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
