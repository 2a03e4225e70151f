"""Tests of optimized/graphs.py's capture: which buckets are warmed up, and that every bucket's graph replays its eager
result (on CUDA), including a bucket whose first call cannot be captured."""

from __future__ import annotations

import gc

import pytest
import torch

from optimized.graphs import GraphRunner, bucket_sizes, prefill_bucket_sizes, warmup_sizes
from optimized.kernels.layer_ops import rms_norm


def _size_class(s: int) -> tuple[int, int, bool]:
    return (s if s <= 8 else 0, 1 << (s - 1).bit_length(), s % 16 == 0)


@pytest.mark.parametrize("sizes", [bucket_sizes(2048), prefill_bucket_sizes(2048), bucket_sizes(256),
                                   bucket_sizes(200), bucket_sizes(5), [48, 96, 100]])
def test_warmup_sizes_cover_every_size_class(sizes):
    warm = warmup_sizes(sizes)
    assert set(warm) <= set(sizes) and max(sizes) in warm and warm == sorted(warm)
    assert {_size_class(s) for s in warm} == {_size_class(s) for s in sizes}
    assert len(warm) <= len({_size_class(s) for s in sizes}) + 1  # one bucket a class, and the largest
    assert all(s in warm for s in sizes if s <= 8)  # every size a batch-1 step runs is warmed itself


def test_warmup_sizes_are_a_fraction_of_the_buckets():
    assert len(warmup_sizes(bucket_sizes(2048))) <= len(bucket_sizes(2048)) // 3
    assert warmup_sizes([]) == []


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
def test_every_bucket_replays_its_eager_result():
    """A Triton kernel specialised on the row count (RMSNorm over n rows) and a cuBLAS matmul: graphs captured after
    the sparse warm-up replay exactly what the same call computes eagerly, at every bucket."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 64, device="cuda", generator=g)
    w = torch.randn(64, device="cuda", generator=g)
    m = torch.randn(64, 48, device="cuda", generator=g)

    def fn(n: int):
        h, _ = rms_norm(x[:n], w, 1e-6, backend="triton")
        return (h @ m,)

    sizes = bucket_sizes(300)
    runner = GraphRunner("test", fn, sizes, enabled=True)
    runner.capture()
    assert sorted(runner.graphs) == sizes
    for s in sizes:
        expected = fn(s)[0].clone()
        torch.testing.assert_close(runner.run(s)[0], expected, rtol=0, atol=0)


@pytest.mark.gpu
@gpu
def test_a_capture_that_fails_names_the_bucket_and_the_way_out():
    """A first call that synchronises (forbidden inside a capture) at a size the warm-up skipped: start-up stops with
    the size and the flag that serves without graphs, not with CUDA's bare message."""
    x = torch.arange(64, dtype=torch.float32, device="cuda")
    seen: set[int] = set()

    def fn(n: int):
        if n not in seen:
            seen.add(n)
            torch.cuda.synchronize()  # what a lazy first-call initialisation might do
        return (x[:n] * 2,)

    sizes = [1, 16, 24, 40, 56, 64]  # 56 is in 40's class (next power of two 64, not a multiple of 16): not warmed
    assert sorted(set(sizes) - set(warmup_sizes(sizes))) == [56]
    expected = r"(?s)test graph of 56 failed \(a size the warm-up skipped\).*--enforce-eager"
    with pytest.raises(RuntimeError, match=expected):
        GraphRunner("test", fn, sizes, enabled=True).capture()


@pytest.mark.gpu
@gpu
def test_garbage_collection_waits_for_the_capture():
    """An engine dropped in a reference cycle (its graphs freed only by the garbage collector) while another captures:
    a collection inside the capture would destroy graphs while the stream captures, which CUDA forbids. The garbage
    appears mid-capture here, with the collector as eager as it goes (threshold 1): the capture must hold it off."""
    x = torch.arange(4096, dtype=torch.float32, device="cuda")
    doomed = [GraphRunner("old", lambda n: (x[:n] * 2,), [16, 32], enabled=True)]
    doomed[0].capture()

    def fn(n: int):
        if doomed and torch.cuda.is_current_stream_capturing():
            holder = {"runner": doomed.pop()}
            holder["self"] = holder  # a cycle: refcounting alone never frees it
            del holder
            junk = [[i] for i in range(64)]  # allocations, on which the collector runs
            del junk
        return (x[:n] * 2,)

    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        new = GraphRunner("new", fn, bucket_sizes(512), enabled=True)
        new.capture()
    finally:
        gc.set_threshold(*thresholds)
    assert not doomed and gc.isenabled()
    gc.collect()  # the dropped runner's graphs go now, outside any capture
    for s in new.sizes:
        torch.testing.assert_close(new.run(s)[0], x[:s] * 2, rtol=0, atol=0)
