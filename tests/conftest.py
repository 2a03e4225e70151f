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


def pooled_chisquare_pvalue(counts: dict, exact: dict, n: int) -> float:
    """p-value of a chi-square test of ``counts`` (outcome -> times seen in ``n`` draws) against the exact
    probabilities ``exact`` (outcome -> p). Cells are pooled, rarest first, until each expects at least 5 draws, so
    the chi-square approximation holds; the expectation is rescaled to the observed total (``exact`` may not sum to
    1 over the outcomes listed)."""
    import scipy.stats

    obs, exp, acc_o, acc_e = [], [], 0, 0.0
    for k in sorted(exact, key=lambda k: exact[k]):
        acc_o += counts.get(k, 0)
        acc_e += exact[k] * n
        if acc_e >= 5:
            obs.append(acc_o)
            exp.append(acc_e)
            acc_o, acc_e = 0, 0.0
    obs[-1] += acc_o
    exp[-1] += acc_e
    exp_t = torch.tensor(exp, dtype=torch.float64)
    exp_t = exp_t * (sum(obs) / exp_t.sum())
    return scipy.stats.chisquare(obs, exp_t.tolist()).pvalue
