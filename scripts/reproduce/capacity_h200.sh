#!/usr/bin/env bash
# The drafter's capacity check on one H200 (~12 min): can the architecture fit text it has seen? If a drafter trained
# for many epochs on N greedy answers cannot reach a high τ on those very prompts, the limit is capacity (depth,
# width, Markov rank), not data, and more data will not close the gap.
#   1. greedy answers (MAX_NEW tokens) to the first N_PROMPTS ShareGPT training prompts, with the prompts written out
#      in the evaluation scripts' prompt-file format;
#   2. for each depth in DEPTHS: a drafter trained from scratch on those answers only, TRAIN_MIN minutes each (tens of
#      epochs), evaluated on the same data;
#   3. τ per slot on the first EVAL_N of those prompts, greedy, EVAL_TOKENS tokens (≤ MAX_NEW, so the continuation is
#      the memorised one), for every depth and for the shipped drafter;
#   4. $RES/capacity.json + capacity.png (scripts/report_acceptance.py).
# Needs the target at $MODEL and ShareGPT at $SHAREGPT (docs/training.md, "Reproduction scripts on a GPU machine"). Run it on a
# copy of the repository, in the background; `bash scripts/reproduce/pack.sh` packs $RES for the trip back.
# The first run (4 min per depth, ~465 optimizer steps of 16,384 tokens) stopped with the loss still falling steeply
# (docs/benchmarks/index.md, "Capacity check"); the run that separates "cannot fit" from "was not given the steps"
# gives each depth about ten times the steps (~5,000): smaller batches and more minutes, e.g. TRAIN_MIN=10
# TRAIN_EXTRA="--tokens-per-batch 4096" (~30 min in all; check steps_done in capacity-train-L*-summary.json).
# A CPU dry run: MODEL=smollm2-135m-instruct SHAREGPT= DEVICE=cpu N_PROMPTS=8 MAX_NEW=16 EVAL_N=4 EVAL_TOKENS=8
#   DEPTHS=1 TRAIN_EXTRA="--steps 4 --tokens-per-batch 2048" RES=/tmp/res-dry DATA=/tmp/capacity-dry
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-/tmp/stage/target.gguf}
SHAREGPT=${SHAREGPT-/tmp/stage/sharegpt.json.gz}   # empty: the packaged ShareGPT file
DEVICE=${DEVICE:-auto}
N_PROMPTS=${N_PROMPTS:-2048}
MAX_NEW=${MAX_NEW:-256}
DEPTHS=${DEPTHS:-2 4}
TRAIN_MIN=${TRAIN_MIN:-4}
EVAL_N=${EVAL_N:-256}
EVAL_TOKENS=${EVAL_TOKENS:-256}
SHIPPED=${SHIPPED:-checkpoints/smollm2-135m-instruct-dspark}
RES=${RES:-/tmp/res}
DATA=${DATA:-/tmp/capacity}
read -r -a TRAIN_EXTRA <<< "${TRAIN_EXTRA:-}"
SOURCE=(); [ -n "$SHAREGPT" ] && SOURCE=(--sharegpt-file "$SHAREGPT")
source "$(dirname "$0")/timeline.sh"  # stamp, run

run capacity-data python -m scripts.make_dataset --out "$DATA/data" --model "$MODEL" "${SOURCE[@]}" \
  --device "$DEVICE" --limit "$N_PROMPTS" --temperatures 0 --max-new-tokens "$MAX_NEW" --batch-size 512 \
  --shard-size 1024 --prompts-out "$DATA/prompts.jsonl" || exit 1
cp "$DATA/data/manifest.json" "$RES/capacity-data-manifest.json"

evals=()
tau() {  # tau NAME LABEL DRAFTER_DIR: τ of one drafter on the fitted prompts, LABEL in the report
  run "capacity-tau-$1" python -m scripts.eval_acceptance --drafter "$3" --prompts-file "$DATA/prompts.jsonl" \
    --limit "$EVAL_N" --model "$MODEL" --device "$DEVICE" --temperature 0 --max-new-tokens "$EVAL_TOKENS" \
    --batch-size 64 --json "$RES/capacity-tau-$1.json" && evals+=("--eval" "$2:0=$RES/capacity-tau-$1.json")
}
for depth in $DEPTHS; do
  # The training set is its own evaluation set: the question is how well it is fitted, not how it generalises.
  run "capacity-train-L$depth" python -m scripts.train_drafter --data "$DATA/data" --eval-data "$DATA/data" \
    --eval-examples 256 --model "$MODEL" --device "$DEVICE" --out "$DATA/L$depth" --num-layers "$depth" \
    --steps 0 --time-budget-min "$TRAIN_MIN" --eval-every 200 --log-every 50 --no-resume "${TRAIN_EXTRA[@]}" &&
    cp "$DATA/L$depth/summary.json" "$RES/capacity-train-L$depth-summary.json" &&
    tau "L$depth" "$depth layers, fitted to $N_PROMPTS greedy answers" "$DATA/L$depth"
done
tau shipped "shipped drafter" "$SHIPPED"
run capacity-report python -m scripts.report_acceptance "${evals[@]}" --out "$RES/capacity" \
  --note "Capacity check: drafters trained from scratch for $TRAIN_MIN min each on greedy answers ($MAX_NEW tokens) to \
the first $N_PROMPTS ShareGPT training prompts, τ measured greedily on the first $EVAL_N of those same prompts \
($EVAL_TOKENS tokens, γ = 7, full block verified); the shipped drafter on the same prompts for comparison. Command: \
bash scripts/reproduce/capacity_h200.sh"
stamp DONE
touch "$RES/DONE"
