"""DSpark reference implementation: readable eager PyTorch, the textbook and the test oracle.

Every module implements one part of ``design/METHOD.md`` and follows its notation.
``reference`` never imports ``optimized``.
"""
