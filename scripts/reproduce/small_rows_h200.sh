#!/usr/bin/env bash
# The verify block's projections on one H200 or H100 (~12 min): the tl.dot launches of 3-16-row steps
# (DOT_TILES in optimized/kernels/linear.py: split K, the norm's pass in one tile, the pipeline depth).
#   1. the linear kernels' and RoPE table's GPU tests (split K against the definition, its bits on 20 calls in a row)
#   2. scripts/bench_linear.py: the projection chain at 1 and 8 rows and the tile sweep of each fused op at 8 rows
#                                                                   -> linear-splitk-GPU.json
#   3. scripts/ab_engine.py --experiment small_rows: the engine with the sweep's proposed table (--dot-tiles) against
#      PREVIOUS_DOT_TILES, alternated in one process, plain decoding and fixed K = 7 one step ahead at batch 1 and 2
#                                                                   -> small-rows-ab-GPU.json
#   4. scripts/profile_engine.py of fixed K = 7 at batch 1, one step ahead, with the table in force and with the
#      sweep's (--dot-tiles): the step's time apart from τ, which another summation order moves in bfloat16
#                                                   -> profile-GPU-fixed7-b1.json, profile-GPU-fixed7-b1-splitk.json
# Needs the target at $MODEL and ShareGPT at $SHAREGPT (docs/training.md, "Reproduction scripts on a GPU machine").
# Run it on a copy of the repository; `bash scripts/reproduce/pack.sh` packs $RES for the trip back.
set -uo pipefail
source "$(dirname "$0")/staged.sh"  # environment, MODEL, SHAREGPT, DRAFTER, RES, SRC, GPU; stamp, run

run tests timeout 150 python -m pytest -q -p no:cacheprovider -k "gpu or cuda" tests/equivalence/test_linear.py \
  tests/equivalence/test_layer_ops.py
run sweep timeout 480 python -m scripts.bench_linear --sweep --sweep-rows 8 --rows 1,8 --repeats 5 \
  --out "$RES/linear-splitk-$GPU.json"
run ab timeout 330 python -m scripts.ab_engine --experiment small_rows --rounds 2 --out "$RES/small-rows-ab-$GPU.json" \
  --dot-tiles "$RES/linear-splitk-$GPU.json" \
  -- "${SRC[@]}" --modes none+async,fixed:7+async --batch-sizes 1,2 --min-requests 16 --hf-max-batch 0 --repeats 2
run profile timeout 100 python -m scripts.profile_engine "${SRC[@]}" --mode fixed:7 --batch-size 1 --async-decode \
  --out "$RES/profile-$GPU-fixed7-b1.json"
run profile-splitk timeout 100 python -m scripts.profile_engine "${SRC[@]}" --mode fixed:7 --batch-size 1 \
  --async-decode --dot-tiles "$RES/linear-splitk-$GPU.json" --out "$RES/profile-$GPU-fixed7-b1-splitk.json"
stamp DONE
touch "$RES/DONE"
