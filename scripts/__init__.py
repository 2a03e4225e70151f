"""The project's command-line programs and their shared library modules; run them as ``python -m scripts.<name>``."""
