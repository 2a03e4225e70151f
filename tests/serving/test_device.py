"""``--device auto`` without torch (optimized/serving/device.py): torch's build read from its ``version.py``, the CUDA
driver asked through ``ctypes``, torch itself only where those cannot settle it. The driver is faked here: these tests
run on CPU machines, with or without a CUDA build of torch."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import pytest

from optimized.serving import device
from tests.serving.conftest import ROOT


@pytest.fixture
def fake_torch(tmp_path, monkeypatch):
    """A fake ``torch`` package (never imported) that find_spec finds; the returned function writes its
    ``version.py``."""
    pkg = tmp_path / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('the fake torch is never imported')\n")
    spec = type("Spec", (), {"origin": str(pkg / "__init__.py")})()
    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: spec if name == "torch" else None)

    def write(text: str) -> None:
        (pkg / "version.py").write_text(textwrap.dedent(text))
    return write


def test_torch_build_reads_version_py_without_importing_it(fake_torch):
    fake_torch("""
        from typing import Optional
        __version__ = '2.11.0+cu130'
        cuda: Optional[str] = '13.0'
        hip: Optional[str] = None
        xpu = None
    """)
    assert device.torch_build() == {"cuda": "13.0", "hip": None, "xpu": None}
    fake_torch("cuda = some_function()\n")
    assert device.torch_build() is None  # not a literal: unsure
    fake_torch("__version__ = '2.0'\n")
    assert device.torch_build() is None  # no cuda field: unsure


class FakeDriver:
    """libcuda.so.1's three calls, with chosen results."""

    def __init__(self, init: int = 0, count: int = 1, version: int = 13000) -> None:
        self.init, self.count, self.version = init, count, version

    def cuInit(self, flags):
        return self.init

    def cuDeviceGetCount(self, ref):
        ref._obj.value = self.count
        return 0

    def cuDriverGetVersion(self, ref):
        ref._obj.value = self.version
        return 0


@pytest.mark.parametrize("driver, torch_cuda, expected", [
    (FakeDriver(), "13.0", True),
    (FakeDriver(version=13020), "13.0", True),  # a newer driver runs older toolkits
    (FakeDriver(version=12080), "13.0", None),  # an older major release: only torch can tell
    (FakeDriver(count=0), "13.0", False),
    (FakeDriver(init=100), "12.8", False),  # CUDA_ERROR_NO_DEVICE (e.g. CUDA_VISIBLE_DEVICES="")
    (FakeDriver(init=3), "12.8", None),  # any other failure: torch decides
    (None, "12.8", None),  # no driver library where this process looks: torch decides
])
def test_cuda_driver_has_device(monkeypatch, driver, torch_cuda, expected):
    def cdll(name):
        assert name == "libcuda.so.1"
        if driver is None:
            raise OSError("libcuda.so.1: cannot open shared object file")
        return driver

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    assert device.cuda_driver_has_device(torch_cuda) is expected


def test_detect_device_asks_torch_only_when_unsure(fake_torch, monkeypatch):
    monkeypatch.setattr(device, "cuda_driver_has_device", lambda v: {"13.0": True, "12.8": False, "11.8": None}[v])
    for text, expected in (("cuda = None\nhip = None\n", "cpu"), ("cuda = '13.0'\n", "cuda"),
                           ("cuda = '12.8'\n", "cpu")):
        fake_torch(text)
        assert device.detect_device() == expected, text
    # Unsure (an old driver; a ROCm build): torch decides. Here that is this machine's real torch.
    import torch

    real = "cuda" if torch.cuda.is_available() else "cpu"
    for text in ("cuda = '11.8'\n", "cuda = None\nhip = '6.2'\n"):
        fake_torch(text)
        assert device.detect_device() == real, text


def test_resolving_the_flags_imports_no_torch_on_this_machine():
    """API server 0 resolves ``--device auto`` and the dtype without torch, so the engine process starts first."""
    code = ("import sys; from optimized.serve import build_parser, resolve; "
            "sa = resolve(build_parser().parse_args([])); print(sa.device, sa.dtype, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    import torch

    found, dtype, imported = out.stdout.split()
    assert found == ("cuda" if torch.cuda.is_available() else "cpu")
    assert dtype == ("bfloat16" if found == "cuda" else "float32")
    if device.torch_build() == {"cuda": None, "hip": None, "xpu": None} or found == "cuda":
        assert imported == "False"  # a CPU-only torch, or a driver that answered: no torch in server 0


def test_device_cuda_without_a_device_is_refused(monkeypatch):
    from optimized.serve import build_parser, resolve

    monkeypatch.setattr(device, "detect_device", lambda: "cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve(build_parser().parse_args(["--device", "cuda"]))
    monkeypatch.setattr(device, "detect_device", lambda: "cuda")
    sa = resolve(build_parser().parse_args(["--device", "cuda", "--dtype", "float16"]))
    assert (sa.device, sa.dtype, sa.max_num_seqs) == ("cuda", "float16", 256)


def test_the_engine_refuses_a_device_torch_cannot_use(monkeypatch):
    """Where the driver answered ``cuda`` but this torch cannot use it, the engine stops before loading anything,
    naming the way out."""
    import torch

    from optimized.serve import build_parser, build_runtime, resolve

    monkeypatch.setattr(device, "detect_device", lambda: "cuda")
    sa = resolve(build_parser().parse_args([]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="this torch .* cannot use it: pass --device cpu"):
        build_runtime(sa)
