"""The fused per-row loss kernel (optimized/kernels/distill_loss.py) against its torch definition.

The torch definition is the chunk body the fast training loss always had (``distill_rows_torch``), itself checked
against ``reference.losses.dspark_loss`` by ``test_training.py``. The Triton cases run through Triton's interpreter
on the CPU (``TRITON_INTERPRET=1``, set by the CI command) or on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from optimized.kernels.distill_loss import ROW_STATS, distill_rows, distill_rows_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not (DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"),
                                  reason="the Triton kernel on CPU needs TRITON_INTERPRET=1 (the CI command sets it)")
WEIGHTS = [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.1, 0.0, 0.9), (0.3, 0.5, 0.2)]  # (w_ce, w_kl, w_l1)
# The gradient in float32: the kernel normalises each row by a logsumexp accumulated tile by tile, torch in one pass.
# They usually agree within 6e-8, but a CI run once measured a 3.7e-5 relative gap on the largest entries of two rows
# (one row normaliser off by a few tens of ulps); a wrong gradient is off by orders of magnitude more.
GRAD_TOL = {"atol": 1e-6, "rtol": 1e-4}


def _rows(gamma=3, T=4, V=4500, seed=0, dtype=torch.float32, special=True):
    """Random rows; ``special``: an exact tie, teacher rows with -inf entries (a masked vocabulary), a zero-weight
    row (needs T ≥ 3 and V > 4000)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(gamma * T, V, generator=g) * 3
    t = torch.randn(T, V, generator=g) * 2
    labels = torch.randint(0, V, (gamma * T,), generator=g)
    weight = torch.rand(gamma * T, generator=g)
    if special:
        t[1, :700] = float("-inf")  # whole tiles of impossible tokens
        t[2, V - 5:] = float("-inf")
        z[2, 11] = z[2, 4000] = z[2].max() + 1  # a tie across tiles: the lowest index wins
        t[0, 9] = t[0, 2100] = t[0].max() + 1
        labels[2] = 11
        weight[5] = 0.0
    return z.to(DEVICE, dtype), t.to(DEVICE, dtype), labels.to(DEVICE), weight.to(DEVICE)


@needs_triton
@pytest.mark.parametrize("weights", WEIGHTS)
def test_kernel_equals_the_torch_definition(weights):
    z, t, labels, weight = _rows()
    grad, stats = distill_rows(z, t, labels, weight, weights, backend="triton")
    ref_grad, ref_stats = distill_rows_torch(z, t, labels, weight, weights)
    torch.testing.assert_close(grad, ref_grad, **GRAD_TOL)
    torch.testing.assert_close(stats, ref_stats, atol=2e-5, rtol=1e-5)
    assert stats[2, ROW_STATS.index("label_hit")] == 1.0  # the tie resolved to the lower index, 11
    assert not grad[5].any()  # a row of weight 0 gets no gradient


@needs_triton
def test_kernel_writes_the_gradient_over_the_logits():
    z, t, labels, weight = _rows()
    ref_grad, ref_stats = distill_rows_torch(z, t, labels, weight, (0.3, 0.5, 0.2))
    buf = z.clone()
    grad, stats = distill_rows(buf, t, labels, weight, (0.3, 0.5, 0.2), out=buf, backend="triton")
    assert grad.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(grad, ref_grad, **GRAD_TOL)
    torch.testing.assert_close(stats, ref_stats, atol=2e-5, rtol=1e-5)


@needs_triton
def test_kernel_reads_bf16_and_writes_bf16():
    """The training dtype: bf16 logits in, bf16 gradient out, float32 arithmetic inside."""
    z, t, labels, weight = _rows(dtype=torch.bfloat16)
    grad, stats = distill_rows(z, t, labels, weight, (0.0, 1.0, 0.0), grad_dtype=torch.bfloat16, backend="triton")
    ref_grad, ref_stats = distill_rows_torch(z, t, labels, weight, (0.0, 1.0, 0.0), grad_dtype=torch.bfloat16)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-6, rtol=1e-2)
    torch.testing.assert_close(stats, ref_stats, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_triton), "torch"])
def test_gradient_is_the_derivative_of_the_loss(backend):
    """dL/dz from the op equals autograd through the definition of L = Σ a (w_ce ce + w_kl kl + w_l1 l1)."""
    z, t, labels, weight = _rows(gamma=2, T=2, V=300, special=False)
    w_ce, w_kl, w_l1 = 0.3, 0.5, 0.2
    zz = z.double().requires_grad_()
    log_p_d = zz.log_softmax(-1)
    log_p_t = t.double().log_softmax(-1).repeat_interleave(2, 0)
    ce = -log_p_d.gather(1, labels[:, None]).squeeze(1)
    kl = (log_p_t.exp() * (log_p_t - log_p_d)).sum(-1)
    l1 = (log_p_d.exp() - log_p_t.exp()).abs().sum(-1)
    (weight.double() * (w_ce * ce + w_kl * kl + w_l1 * l1)).sum().backward()
    grad, stats = distill_rows(z, t, labels, weight, (w_ce, w_kl, w_l1), backend=backend)
    torch.testing.assert_close(grad.double(), zz.grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(stats[:, :3].double(), torch.stack((ce, l1, kl), 1).detach(), atol=1e-4, rtol=1e-5)


def test_shapes_are_checked():
    z, t, labels, weight = _rows(gamma=2, T=2, V=50, special=False)
    with pytest.raises(ValueError, match="γ rows per target row"):
        distill_rows(z[:3], t, labels[:3], weight[:3], (1.0, 0.0, 0.0), backend="torch")
    with pytest.raises(ValueError, match="share V"):
        distill_rows(z, t[:, :10], labels, weight, (1.0, 0.0, 0.0), backend="torch")
    with pytest.raises(ValueError, match="labels and row_weight"):
        distill_rows(z, t, labels[:2], weight, (1.0, 0.0, 0.0), backend="torch")
