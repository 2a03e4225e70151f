#!/usr/bin/env bash
# The serving frontier and start-up times on one H200 (~12 min), docs/benchmarks/serving-h200.{json,png}:
#   1. scripts/bench_serving.py --launch: one `python -m optimized.serve` per mode (none, fixed K = 1, 3, 5, 7, dsd,
#      adaptive), concurrency 1, 4, 16, 64, 256, held-out ShareGPT prompts in file order, OUTPUT_LEN tokens each
#      (ignore_eos), greedy; each launch's time to /health 200 is recorded (the first one, on a fresh machine, is the
#      cold start-up; the rest are warm: Triton's kernel cache is filled);
#   2. with BENCH_ENGINE=1, the engine alone on the same held-out prompts (scripts/bench_engine.py, same modes and
#      batch sizes), for the server's own cost: bench_serving against bench_engine at the same concurrency.
# Needs the target at $MODEL and ShareGPT at $SHAREGPT (docs/training.md, "Reproduction scripts on a GPU machine"). Run it on a
# copy of the repository, in the background; `bash scripts/reproduce/pack.sh` packs $RES for the trip back.
# A CPU dry run: MODEL=smollm2-135m-instruct SHAREGPT= MODES=none,adaptive CONCURRENCY=1 OUTPUT_LEN=8 BENCH_ENGINE=0
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-/tmp/stage/target.gguf}
SHAREGPT=${SHAREGPT-/tmp/stage/sharegpt.json.gz}   # empty: the packaged ShareGPT file
DRAFTER=${DRAFTER:-checkpoints/smollm2-135m-instruct-dspark}
MODES=${MODES:-none,fixed:1,fixed:3,fixed:5,fixed:7,dsd,adaptive}
CONCURRENCY=${CONCURRENCY:-1,4,16,64,256}
OUTPUT_LEN=${OUTPUT_LEN:-128}
BENCH_ENGINE=${BENCH_ENGINE:-1}
ENGINE_MODES=${ENGINE_MODES:-$MODES}                 # bench_engine's modes and batch sizes (default: the server's)
ENGINE_BATCH_SIZES=${ENGINE_BATCH_SIZES:-$CONCURRENCY}
ENGINE_BUDGET_S=${ENGINE_BUDGET_S:-240}
RES=${RES:-/tmp/res}
NAME=${NAME:-serving-h200}   # $RES/$NAME.{json,png}; an A/B of the server: NAME=serving-h200-each-step
                             # SERVER_EXTRA=--stream-each-step (one chunk per engine step) beside a default run
read -r -a SERVER_EXTRA <<< "${SERVER_EXTRA:-}"   # e.g. "--device cpu" for a dry run on a GPU machine
read -r -a BENCH_EXTRA <<< "${BENCH_EXTRA---min-requests 64 --prompts-per-user 16}"  # more bench_serving flags:
    # the low concurrencies get 64 requests each (16 left single points at concurrency 1 within the machine's
    # run-to-run spread), the high ones 16 a user (4 left seconds-long levels where ramp-up and drain weighed)
SOURCE=(); [ -n "$SHAREGPT" ] && SOURCE=(--sharegpt-file "$SHAREGPT")
source "$(dirname "$0")/timeline.sh"  # stamp, run

run "$NAME" python -m scripts.bench_serving --launch --modes "$MODES" --concurrency "$CONCURRENCY" \
  --output-len "$OUTPUT_LEN" "${SOURCE[@]}" --drafter "$DRAFTER" "${BENCH_EXTRA[@]}" \
  --server-args "--model $MODEL --drafter $DRAFTER ${SERVER_EXTRA[*]}" --log-dir "$RES/logs/servers" \
  --out "$RES/$NAME.json" --plot "$RES/$NAME.png"
[ "$BENCH_ENGINE" = 1 ] && run engine python -m scripts.bench_engine --model "$MODEL" "${SOURCE[@]}" \
  --drafter "$DRAFTER" --modes "$ENGINE_MODES" --batch-sizes "$ENGINE_BATCH_SIZES" --max-new-tokens "$OUTPUT_LEN" \
  --repeats 2 --time-budget-s "$ENGINE_BUDGET_S" --out "$RES/engine-serving-prompts-h200.json"
stamp DONE
touch "$RES/DONE"
