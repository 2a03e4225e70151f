#!/usr/bin/env bash
# Where the serving path's host time goes with the real engine on one H200 (~4 min), per mode (MODES, default none
# and adaptive): scripts/profile_server.py --engine real at 64 and 256 users, the default server's layout (the engine
# in its own process, four HTTP processes) and eight client processes, first without and then under py-spy
#                                                     -> docs/benchmarks/serving-host-profile-h200-<mode>.json
# Each level says every process's CPU per delivered token and its share of a core (API server 0, which also takes
# every step's statistics, apart from the other HTTP processes), and splits the engine process's time into the engine
# step and the serving layer's own work. Needs the target at $MODEL (docs/training.md, "Reproduction scripts on a GPU
# machine"), the server's packages and py-spy (`pip install py-spy`; ptrace rights over the server's processes). Run
# it on a copy of the repository; `bash scripts/reproduce/pack.sh` packs $RES for the trip back.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-/tmp/stage/target.gguf}
DRAFTER=${DRAFTER:-checkpoints/smollm2-135m-instruct-dspark}
MODES=${MODES:-none,adaptive}
CONCURRENCY=${CONCURRENCY:-64,256}
RES=${RES:-/tmp/res}
source "$(dirname "$0")/timeline.sh"  # stamp, run

for mode in ${MODES//,/ }; do
  run "profile-$mode" python -m scripts.profile_server --engine real --model "$MODEL" --concurrency "$CONCURRENCY" \
    --api-server-count 4 --client-processes 8 --prompts-per-user 8 --profile --log-dir "$RES/logs/profile-$mode" \
    --server-args "--model $MODEL --drafter $DRAFTER --speculative-config '{\"mode\": \"$mode\"}'" \
    --out "$RES/serving-host-profile-h200-$mode.json"
done
stamp DONE
touch "$RES/DONE"
