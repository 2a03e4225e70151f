#!/usr/bin/env bash
# The server's start-up on one H200 (~3 min on a fresh machine), docs/benchmarks/startup-h200.json:
# scripts/bench_startup.py launches the default server (python -m optimized.serve: adaptive, the shipped drafter,
# the engine in its own process, several HTTP processes) LAUNCHES times in a row. On a fresh machine the first launch
# is the cold start (Triton compiles every kernel, the step-cost table is profiled), the later ones are warm.
# Needs the target at $MODEL (docs/training.md, "Reproduction scripts on a GPU machine"). Run it on a copy of the
# repository; `bash scripts/reproduce/pack.sh` packs $RES for the trip back.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-/tmp/stage/target.gguf}
DRAFTER=${DRAFTER:-checkpoints/smollm2-135m-instruct-dspark}  # a staged .gguf path does not name its drafter
LAUNCHES=${LAUNCHES:-3}
RES=${RES:-/tmp/res}
source "$(dirname "$0")/timeline.sh"  # stamp, run

run startup python -m scripts.bench_startup --launches "$LAUNCHES" --server-args "--model $MODEL --drafter $DRAFTER" \
  --log-dir "$RES/logs/startup" --out "$RES/startup-h200.json"
stamp DONE
