#!/usr/bin/env bash
# Our serving client cross-checked with GuideLLM on one H200 (~4 min): for each of MODES (default none and adaptive)
# one `python -m optimized.serve` on port $PORT, then scripts/peer_check_serving.py at concurrency 64 and 256 (the
# same held-out ShareGPT prompts, OUTPUT_LEN tokens each, greedy, for both clients)
#                                                          -> docs/benchmarks/serving-peer-h200-<mode>.json
# Needs the target at $MODEL and ShareGPT at $SHAREGPT (docs/training.md, "Reproduction scripts on a GPU machine"),
# the server's packages, and GuideLLM (`pip install guidellm`; $GUIDELLM names its command). Run it on a copy of the
# repository; `bash scripts/reproduce/pack.sh` packs $RES for the trip back. A CPU dry run:
# MODEL=smollm2-135m-instruct SHAREGPT= MODES=none CONCURRENCY=2 OUTPUT_LEN=4 REQUESTS_PER_USER=2 MIN_REQUESTS=4
# MAX_NUM_SEQS=4
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
MODEL=${MODEL:-/tmp/stage/target.gguf}
SHAREGPT=${SHAREGPT-/tmp/stage/sharegpt.json.gz}   # empty: the packaged ShareGPT file
DRAFTER=${DRAFTER:-checkpoints/smollm2-135m-instruct-dspark}
MODES=${MODES:-none,adaptive}
CONCURRENCY=${CONCURRENCY:-64,256}
OUTPUT_LEN=${OUTPUT_LEN:-128}
REQUESTS_PER_USER=${REQUESTS_PER_USER:-8}  # requests a level: max(this x concurrency, MIN_REQUESTS)
MIN_REQUESTS=${MIN_REQUESTS:-64}
GUIDELLM=${GUIDELLM:-guidellm}
PORT=${PORT:-8765}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-256}
RES=${RES:-/tmp/res}
SOURCE=(); [ -n "$SHAREGPT" ] && SOURCE=(--sharegpt-file "$SHAREGPT")
# scripts/bench_engine.py reports on the same prompts, space-separated (serving_h200.sh's engine run, say): each level
# then records the engine alone and each client's share of it
ENGINE=(); for f in ${ENGINE_REPORTS:-}; do ENGINE+=(--engine-report "$f"); done
source "$(dirname "$0")/timeline.sh"  # stamp, run

for mode in ${MODES//,/ }; do
  stamp "server $mode"
  python -m optimized.serve --model "$MODEL" --drafter "$DRAFTER" --port "$PORT" --max-num-seqs "$MAX_NUM_SEQS" \
    --speculative-config "{\"mode\": \"$mode\"}" > "$RES/logs/serve-$mode.log" 2>&1 &
  server=$!
  for _ in $(seq 1 240); do  # up to 4 minutes to /health 200 (a cold start compiles the kernels)
    python -c "import sys, urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" \
      2>/dev/null && break
    kill -0 "$server" 2>/dev/null || break
    sleep 1
  done
  if ! kill -0 "$server" 2>/dev/null; then stamp "server $mode exited during start-up: logs/serve-$mode.log"; continue; fi
  run "peer-$mode" python -m scripts.peer_check_serving --base-url "http://127.0.0.1:$PORT" --label "$mode" \
    --model "$MODEL" "${SOURCE[@]}" --concurrency "$CONCURRENCY" --output-len "$OUTPUT_LEN" \
    --requests-per-user "$REQUESTS_PER_USER" --min-requests "$MIN_REQUESTS" --guidellm "$GUIDELLM" \
    "${ENGINE[@]}" --out "$RES/serving-peer-h200-$mode.json"
  kill -TERM "$server" 2>/dev/null; wait "$server"
done
stamp DONE
touch "$RES/DONE"
