"""Where a script runs: the device it picks and the name of the hardware it reports with its results."""

from __future__ import annotations

import os
import platform

import torch


def resolve_device(name: str) -> torch.device:
    """``auto`` -> ``cuda:LOCAL_RANK`` when CUDA is available (torchrun sets LOCAL_RANK), else ``cpu``."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    return torch.device(name)


def hardware(device: torch.device, world: int = 1) -> str:
    """``"1x NVIDIA H200"`` on CUDA (``world`` GPUs), ``"CPU x86_64 (2 threads)"`` otherwise."""
    if device.type == "cuda":
        return f"{world}x {torch.cuda.get_device_name(device)}"
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
