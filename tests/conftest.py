"""Shared fixtures. The tiny random models themselves are built by ``reference.testing`` (importable anywhere)."""

from __future__ import annotations

import pytest
import torch

# Test modules import these from here as well as from reference.testing.
from reference.testing import (  # noqa: F401
    TINY_D,
    TINY_GAMMA,
    TINY_TAPS,
    TINY_V,
    tiny_drafter,
    tiny_drafter_config,
    tiny_hf_model,
)


@pytest.fixture(params=["llama", "qwen3"])
def tiny_family(request):
    return request.param


@pytest.fixture(scope="session")
def smollm2_target():
    """The default target, SmolLM2-135M-Instruct, in fp32 on CPU (first run dequantizes and caches it, ~25 s)."""
    from reference.target import Target

    return Target.load()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls run faster on one thread, and the CI machine is shared (use via ``pytestmark``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
