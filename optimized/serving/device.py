"""Which device ``--device auto`` means, answered without importing torch where the answer is certain.

API server 0 needs the device before it starts the engine process: the device decides whether the engine gets a
process of its own, how many HTTP processes share the port and how many slots there are. Importing torch only to
ask ``torch.cuda.is_available()`` costs API server 0 one to three seconds, and the engine process cannot start
before the answer, so the server asks the two things that answer decides on instead:

1. how the installed torch was built, from its ``torch/version.py`` (read as text, not imported): a CPU-only build
   never sees a GPU;
2. for a CUDA build, the CUDA driver itself (``libcuda.so.1`` through ``ctypes``): ``cuInit`` and
   ``cuDeviceGetCount`` see the devices ``CUDA_VISIBLE_DEVICES`` leaves, as torch does, and ``cuDriverGetVersion``
   says whether the driver is new enough for the CUDA release torch was built with.

Where either step cannot be sure (a ROCm or other build, an unreadable ``version.py``, a driver older than torch's
CUDA major release), it imports torch and asks it. The engine process checks the answer against torch before it
loads anything (``optimized.serve.build_runtime``).
"""

from __future__ import annotations

import ast
import ctypes
import importlib.util
import os

CUDA_ERROR_NO_DEVICE = 100  # cuInit's answer where the driver sees no device



def torch_build() -> dict[str, str | None] | None:
    """The ``cuda`` / ``hip`` / ``xpu`` fields of the installed torch's ``version.py`` (None: torch is missing or
    the file does not read as literal assignments)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    fields: dict[str, str | None] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id in ("cuda", "hip", "xpu"):
            try:
                fields[target.id] = ast.literal_eval(value)
            except ValueError:
                return None
    return fields if "cuda" in fields else None


def cuda_driver_has_device(torch_cuda: str) -> bool | None:
    """Whether the CUDA driver shows at least one device that a torch built for CUDA ``torch_cuda`` (e.g. "13.0")
    can use: False where the driver sees no device, None where only torch can tell (no driver library found, a driver
    of an older major release than torch's CUDA, a driver call that fails otherwise)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None  # no driver where this process looks (a laptop's CUDA build of torch, say): torch decides
    try:
        status = lib.cuInit(0)
        if status == CUDA_ERROR_NO_DEVICE:  # also with CUDA_VISIBLE_DEVICES=""
            return False
        if status != 0:
            return None
        count, version = ctypes.c_int(0), ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except AttributeError:  # not the CUDA driver API
        return None
    if count.value < 1:
        return False
    try:
        major = int(torch_cuda.split(".")[0])
    except ValueError:
        return None
    # Within a major release the driver runs newer toolkits (minor-version compatibility); across one it may not.
    return True if version.value // 1000 >= major else None


def detect_device() -> str:
    """``"cuda"`` where torch would find a CUDA device, else ``"cpu"``: from torch's build and the driver where they
    settle it, from ``torch.cuda.is_available()`` otherwise."""
    build = torch_build()
    if build is not None and build.get("hip") is None and build.get("xpu") is None:
        if build["cuda"] is None:
            return "cpu"  # a CPU-only build of torch
        answer = cuda_driver_has_device(build["cuda"])
        if answer is not None:
            return "cuda" if answer else "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
