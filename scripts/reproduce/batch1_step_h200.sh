#!/usr/bin/env bash
# The small-batch step on one H200 (~10 min): the fused projections (optimized/kernels/linear.py) against cuBLAS.
#   1. the linear kernels' GPU tests: compiled equivalence with the torch twin, and row invariance up to 16 rows
#   2. scripts/bench_linear.py: one layer's projection chain in a CUDA graph, unfused and fused, at 1..32 token rows
#      (fused: the row loop up to 2 rows, tl.dot tiles above), and the tile sweep of each fused op at 8 and 16 rows
#                                                                       -> docs/benchmarks/linear-small-rows-h200.json
#   3. scripts/bench_engine.py at batch 1, 2 and 4, plain decoding and fixed K = 7, with the fused projections up to
#      2 rows and up to 16 rows (--linear-rows), one run each        -> engine-lr2.json, engine-lr16.json
#   4. scripts/profile_engine.py of fixed K = 7 at batch 1 with both limits -> profile-h200-fixed7-b1-lr{2,16}.json
#   5. every other gpu-marked test, and the kernels' equivalence tests compiled for the GPU
# Needs the target at $MODEL and ShareGPT at $SHAREGPT (docs/training.md, "Reproduction scripts on a GPU machine").
# Run it on a copy of the repository; `bash scripts/reproduce/pack.sh` packs $RES for the trip back.
set -uo pipefail
source "$(dirname "$0")/staged.sh"  # environment, MODEL, SHAREGPT, DRAFTER, RES, SRC, GPU; stamp, run

run tests-linear timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/equivalence/test_linear.py
run linear timeout 300 python -m scripts.bench_linear --rows 1,2,4,8,16,32 --sweep --sweep-rows 8,16 \
  --sweep-max-configs 24 --out "$RES/linear-small-rows-h200.json"
for LR in 2 16; do
  run "engine-lr$LR" timeout 150 python -m scripts.bench_engine "${SRC[@]}" --batch-sizes 1,2,4 --min-requests 16 \
    --modes none+async,fixed:7,fixed:7+async --repeats 3 --hf-max-batch 0 --linear-rows "$LR" \
    --out "$RES/engine-lr$LR.json"
done
for LR in 2 16; do
  run "profile-lr$LR" timeout 90 python -m scripts.profile_engine "${SRC[@]}" --mode fixed:7 --batch-size 1 \
    --async-decode --linear-rows "$LR" --out "$RES/profile-h200-fixed7-b1-lr$LR.json"
done
# the rest of the GPU tests: every gpu-marked test, and the kernels' equivalence tests compiled for the GPU
run tests-gpu timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/equivalence tests/optimized
run tests-kernels timeout 150 python -m pytest -q -p no:cacheprovider tests/equivalence/test_verify.py \
  tests/equivalence/test_draft_head.py tests/equivalence/test_layout.py tests/equivalence/test_allocate.py
stamp DONE
touch "$RES/DONE"
