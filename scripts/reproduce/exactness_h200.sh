#!/usr/bin/env bash
# Exact greedy decoding in bfloat16 on one H200 (~15 min):
#   1. the GPU tests of the row-invariant kernels and of the batch-invariant target
#   2. scripts/bench_linear.py --invariant-sweep: each projection over tl.dot tiles at 1..2048 rows, each tile's bits
#      compared with the row-invariant table's first tile, and a proposed table of the fastest identical tiles by
#      step size                                                        -> docs/benchmarks/linear-invariant-h200.json
#   3. scripts/exactness.py on 64 held-out ShareGPT prompts × 256 tokens, fixed K = 7, dsd and adaptive against plain
#      decoding at batch 1, 16 and 64, with the default kernels and with EngineConfig.batch_invariant on the proposed
#      table (identical prompts, first differences, and the throughput of one setting over the other; set
#      TILES=code to keep the table in the code)                      -> docs/benchmarks/exactness-h200.json
# Needs the target at $MODEL and ShareGPT at $SHAREGPT (docs/training.md, "Reproduction scripts on a GPU machine").
# Run it on a copy of the repository; `bash scripts/reproduce/pack.sh` packs $RES for the trip back.
set -uo pipefail
source "$(dirname "$0")/staged.sh"  # environment, MODEL, SHAREGPT, DRAFTER, RES, SRC, GPU; stamp, run

run tests-invariance timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/equivalence/test_linear.py \
  tests/equivalence/test_gpu.py -k "row_invariant or batch_invariant"
run linear-invariant timeout 420 python -m scripts.bench_linear --rows 1,8,64 --repeats 3 --iters 10 \
  --invariant-sweep 1,8,64,512,2048 --sweep-max-configs 24 --out "$RES/linear-invariant-h200.json"
TILE_ARGS=()
if [ "${TILES:-proposed}" != code ] && python -c "import json, sys
sys.exit('proposed_invariant_tiles' not in json.load(open(sys.argv[1])))" "$RES/linear-invariant-h200.json" 2>/dev/null
then  # the sweep finished and proposed a table
  TILE_ARGS=(--invariant-tiles "$RES/linear-invariant-h200.json")
fi
run exactness timeout 540 python -m scripts.exactness --model "$MODEL" --drafter "$DRAFTER" --sharegpt-file "$SHAREGPT" \
  --limit 64 --max-new-tokens 256 --modes fixed:7,dsd,adaptive --batch-sizes 1,16,64 "${TILE_ARGS[@]}" \
  --json "$RES/exactness-h200.json"
stamp DONE
touch "$RES/DONE"
