"""`kvtier info`'s word on the native kernels: which cupy wheel they need, and what keeps them off."""

from __future__ import annotations

import importlib
import importlib.metadata
import types

import pytest

info = importlib.import_module("kvtier.cli.info")   # the module (the package's `info` is the command)


def test_no_gpu_no_word_on_kernels():
    assert info.kernel_limits(False, None, None, None) == []
    assert info.kernel_limits(False, "13.0", None, None) == []


def test_a_gpu_without_cupy_names_the_wheel_of_torchs_cuda():
    (line,) = info.kernel_limits(True, "13.0", None, None)
    assert "cupy is not installed" in line and "pip install cupy-cuda13x" in line
    (line,) = info.kernel_limits(True, "12.8", None, None)
    assert "pip install cupy-cuda12x" in line


@pytest.mark.parametrize("torch_cuda, cupy_cuda, said", [
    ("13.0", 13, False), ("12.8", 12, False), ("13.0", 12, True), ("12.4", 13, True), ("13.0", None, False),
])
def test_a_cupy_for_another_cuda_than_torchs_is_said(torch_cuda, cupy_cuda, said):
    lines = info.kernel_limits(True, torch_cuda, "14.2.0", cupy_cuda)
    assert bool(lines) == said
    if said:
        major = torch_cuda.split(".")[0]
        assert f"cupy is built for CUDA {cupy_cuda} and torch for CUDA {torch_cuda}" in lines[0]
        assert f"install cupy-cuda{major}x instead of cupy-cuda{cupy_cuda}x" in lines[0]


def test_the_cupy_wheels_cuda_is_read_from_its_name(monkeypatch):
    def dists(*names):
        return lambda: [types.SimpleNamespace(metadata={"Name": n}) for n in names]

    monkeypatch.setattr(importlib.metadata, "distributions", dists("numpy", "cupy-cuda13x", "torch"))
    assert info.cupy_cuda_major() == 13
    monkeypatch.setattr(importlib.metadata, "distributions", dists("CuPy-CUDA12x"))
    assert info.cupy_cuda_major() == 12
    monkeypatch.setattr(importlib.metadata, "distributions", dists("cupy", "numpy"))   # a source build: unknown
    assert info.cupy_cuda_major() is None


def test_a_cupy_wheel_that_does_not_import_is_not_called_missing():
    (line,) = info.kernel_limits(True, "13.0", None, 13)
    assert "cupy-cuda13x is installed but does not import" in line and "not installed" not in line


@pytest.mark.parametrize("switch, said", [("0", True), ("off", True), (" No ", True), ("1", False), (None, False)])
def test_kernels_switched_off_by_the_environment_are_said(switch, said):
    lines = info.kernel_limits(True, "13.0", "14.2.0", 13, switch)
    assert bool(lines) == said
    if said:
        assert f"KVTIER_NATIVE={switch} switches the native kernels off" in lines[0]
    assert info.kernel_limits(False, "13.0", "14.2.0", 13, switch) == []


def test_a_cupy_that_fails_to_import_otherwise_than_importerror_turns_the_kernels_off(tmp_path, monkeypatch):
    """A broken install may raise anything on import: the kernels are off and say why, and `kvtier info` reports
    it, where both had raised it."""
    import sys

    from kvtier.native import loader

    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text("raise RuntimeError('CUDA driver version is insufficient')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setattr(loader, "_cupy", None)
    monkeypatch.setattr(loader, "_cupy_error", None)
    assert loader.cupy_module() is None
    assert loader._cupy_error == "cupy is not importable (RuntimeError: CUDA driver version is insufficient)"
    assert info.gather(str(tmp_path))["versions"]["cupy"] is None
