"""Data generation, training, calibration, profiling, evaluation and benchmarks: command lines and their libraries.

Run a command line as a module, ``python -m scripts.bench_engine --help``, or as a file, ``python
scripts/bench_engine.py --help`` (both need the project installed, ``pip install -e .``). Modules without a
``main`` (``equivalence``, ``benchmarking``) are libraries that several command lines share.
"""
