#!/usr/bin/env bash
# The batch-1 step on one H200 (~8 min): the fused small-batch projections against cuBLAS, three ways.
#   1. scripts/bench_linear.py: one layer's projection chain in a CUDA graph, unfused and fused, at 1..32 token rows,
#      and the tile sweep of each fused op at 1 and 8 rows       -> docs/benchmarks/linear-h200.json
#   2. scripts/bench_engine.py at batch 1, --linear-rows 0 (cuBLAS) and the default, alternating four times
#      (merge the runs' results into one file as docs/benchmarks/engine-h200-linear-ab.json records them)
#   3. scripts/profile_engine.py of plain decoding at batch 1      -> docs/benchmarks/profile-h200-none-b1.json
# Needs the target at $MODEL and ShareGPT at $SHAREGPT (docs/training.md, "Reproduction scripts on a GPU machine").
# Run it on a copy of the repository; `bash scripts/reproduce/pack.sh` packs $RES for the trip back.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-/tmp/stage/target.gguf}
SHAREGPT=${SHAREGPT:-/tmp/stage/sharegpt.json.gz}
RES=${RES:-/tmp/res}
source "$(dirname "$0")/timeline.sh"  # stamp, run

run linear python -m scripts.bench_linear --rows 1,2,4,8,16,32 --sweep --sweep-rows 1,8 --out "$RES/linear-h200.json"
for turn in 1 2; do
  for LR in 0 2; do
    run "engine-ab-$turn-lr$LR" python -m scripts.bench_engine --model "$MODEL" --sharegpt-file "$SHAREGPT" \
      --batch-sizes 1 --min-requests 16 --modes none,none+async --repeats 3 --hf-max-batch 0 --linear-rows "$LR" \
      --out "$RES/engine-ab-$turn-lr$LR.json"
  done
done
run profile-b1 python -m scripts.profile_engine --model "$MODEL" --sharegpt-file "$SHAREGPT" --mode none \
  --batch-size 1 --steps 20 --async-decode --out "$RES/profile-h200-none-b1.json"
stamp DONE
