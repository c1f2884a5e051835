"""The driver launcher's argument buffer (laid out as the kernels' parameters are) and the launcher switch;
launches themselves are checked on a GPU (`tests/cuda/test_native_kernels.py`)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.native import driver_launch, loader


def test_arguments_sit_at_their_natural_alignment():
    """An int32 before a 64-bit argument leaves four bytes of padding, as the kernel's parameter space does."""
    buf = driver_launch.pack((np.int32(-3), np.uint64(2**63 + 5), np.float32(0.5), np.int32(7), np.int64(-9)))
    assert len(buf) == 32
    assert struct.unpack_from("<i", buf, 0)[0] == -3
    assert struct.unpack_from("<Q", buf, 8)[0] == 2**63 + 5
    assert struct.unpack_from("<f", buf, 16)[0] == 0.5
    assert struct.unpack_from("<i", buf, 20)[0] == 7
    assert struct.unpack_from("<q", buf, 24)[0] == -9


def test_every_fixed_width_scalar_packs_at_its_size():
    for t, size in ((np.int8, 1), (np.uint16, 2), (np.uint32, 4), (np.float64, 8), (np.longlong, 8)):
        assert len(driver_launch.pack((t(1),))) == size, t


@pytest.mark.parametrize("bad", [3, 2.5, True])
def test_a_python_number_is_refused_by_name(bad):
    with pytest.raises(TypeError, match=type(bad).__name__):
        driver_launch.pack((np.int32(1), bad))


def test_an_unknown_launcher_is_refused_with_the_allowed_ones(monkeypatch):
    monkeypatch.setenv("KVTIER_LAUNCH", "ctypes")
    with pytest.raises(ConfigError, match="KVTIER_LAUNCH='ctypes' in the environment; allowed: driver, cupy, or unset"):
        loader.launcher()


@pytest.mark.parametrize("value", ["cupy", " Cupy ", "CUPY"])
def test_cupy_is_a_launcher_anywhere(monkeypatch, value):
    monkeypatch.setenv("KVTIER_LAUNCH", value)
    assert loader.launcher() == "cupy"


def test_cupy_sees_torchs_stream_through_the_stream_protocol_where_it_has_it():
    """cupy 14 warns `ExternalStream` deprecated; its `Stream.from_external` takes the stream protocol's
    ``(0, handle)``. Older cupy has only `ExternalStream`."""
    import types

    class Stream:
        @classmethod
        def from_external(cls, obj):
            return ("from_external", obj.__cuda_stream__())

    new = types.SimpleNamespace(cuda=types.SimpleNamespace(Stream=Stream, ExternalStream=None))
    assert loader._cupy_stream(new, 0x7F00) == ("from_external", (0, 0x7F00))
    old = types.SimpleNamespace(cuda=types.SimpleNamespace(Stream=object, ExternalStream=lambda h: ("external", h)))
    assert loader._cupy_stream(old, 0x7F00) == ("external", 0x7F00)
