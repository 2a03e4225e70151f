"""The OpenAI-compatible server behind ``python -m optimized.serve`` (see docs/serving.md).

One room per concern: ``protocol`` (the OpenAI request/response schemas), ``text`` (incremental detokenisation and
stop strings), ``engine_loop`` (the one thread that owns the engine), ``metrics`` (Prometheus), ``app`` (the
FastAPI routes), and ``optimized/serve.py`` (command line, start-up).
"""
