#!/usr/bin/env bash
# The Markov head's launches on one H100 or H200 (~10 min): what set SPLIT_TABLE in optimized/kernels/draft_head.py.
#   1. the draft head's equivalence tests compiled for the GPU (every variant against the torch twin)
#   2. scripts/bench_draft_head.py: every launch of the head in a CUDA graph at the engine's arguments, greedy, R = 1..128
#      (all tiles, warps, fused reductions and requests a program)     -> draft-head-graph-GPU.json
#   3. the same at R = 16..256 with the two widest tiles at four warps  -> draft-head-graph-GPU-wide.json
#   4. sampled rows (T = 1), one request a program                     -> draft-head-graph-GPU-sampled.json
#   5. scripts/ab_engine.py --experiment draft_head: the engine with the table against the launches before it,
#      alternated in one process, closed batches of 1, 16, 64 and 256   -> draft-head-ab-GPU.json
# Needs the target at $MODEL and ShareGPT at $SHAREGPT (docs/training.md, "Reproduction scripts on a GPU machine").
# Run it on a copy of the repository; `bash scripts/reproduce/pack.sh` packs $RES for the trip back.
set -uo pipefail
source "$(dirname "$0")/staged.sh"  # environment, MODEL, SHAREGPT, DRAFTER, RES, SRC, GPU; stamp, run

run tests-draft-head timeout 150 python -m pytest -q -p no:cacheprovider tests/equivalence/test_draft_head.py
run sweep timeout 600 python -m scripts.bench_draft_head --temperatures 0 --batches 1,4,16,32,64,128 \
  --out "$RES/draft-head-graph-$GPU.json"
run sweep-wide timeout 200 python -m scripts.bench_draft_head --temperatures 0 --batches 256,128,64,16 --rows 1 \
  --tiles 32768,65536 --warps 4 --out "$RES/draft-head-graph-$GPU-wide.json"
run sweep-sampled timeout 200 python -m scripts.bench_draft_head --temperatures 1 --batches 256,64,16,1 --rows 1 \
  --tiles 16384,32768 --warps 4,8 --out "$RES/draft-head-graph-$GPU-sampled.json"
run ab timeout 600 python -m scripts.ab_engine --experiment draft_head --rounds 3 --out "$RES/draft-head-ab-$GPU.json" \
  -- "${SRC[@]}" --modes fixed:7+async,adaptive+async --batch-sizes 1,16,64,256 --min-requests 16 --hf-max-batch 0 \
  --repeats 2 --cost-feedback --cost-cache-dir /tmp/costcache
stamp DONE
touch "$RES/DONE"
