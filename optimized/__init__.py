"""DSpark production path: Triton kernels, CUDA graphs, continuous batching, serving.

Every op here has a reference twin in ``reference/`` and an equivalence test in ``tests/equivalence/``.
"""
