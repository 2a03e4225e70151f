"""The stale-row prior A/B under its earlier name: ``scripts/ab_engine.py --experiment stale_prior`` (the command
recorded in docs/benchmarks/stale-prior-ab-h100.json). Arguments as ``scripts/ab_engine.py``."""

from __future__ import annotations

import sys
from typing import Any

from scripts import ab_engine


def main(argv: list[str] | None = None, **bench_kwargs: Any) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    return ab_engine.main(argv, prog="ab_stale_prior", experiment="stale_prior", **bench_kwargs)


if __name__ == "__main__":
    main()
