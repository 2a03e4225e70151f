"""DSpark reference implementation: readable eager PyTorch, the textbook and the test oracle.

Every module implements one part of ``docs/method.md`` and follows its notation.
``reference`` never imports ``optimized``.
"""
