#!/usr/bin/env bash
# One GPU loan of the drafter's long training on one H200 (~20 min). The drafter needs tens of thousands of optimizer
# steps and a loan gives a few thousand, so one learning-rate schedule (--steps STEPS) spans several loans: each loan
#   1. regenerates self-distillation data with the engine, GEN_PROCS processes sharing the GPU for GEN_S seconds
#      (deterministic from DATA_SEED: a later loan passes another seed and trains on fresh samples of the same
#      prompts), plus a small held-out set for the training curve;
#   2. profiles the training step (scripts/bench_training.py --profile) at the batch size it trains with;
#   3. trains for TRAIN_MIN minutes: from scratch on the first loan, from the previous loan's checkpoint
#      (INIT_FROM, which records its step, so the schedule continues) after that;
#   4. measures τ on docs/benchmarks/eval_prompts.jsonl, greedy and T = 1, for the new drafter, and greedy for the
#      shipped drafter in the same run (the baseline);
#   5. leaves the checkpoint (bf16 shards ≤ 15 MB) in $RES/run for the trip back (scripts/reproduce/pack.sh).
# Needs the target at $MODEL and ShareGPT at $SHAREGPT (docs/training.md, "Reproduction scripts on a GPU machine").
# A CPU dry run: MODEL=smollm2-135m-instruct SHAREGPT= DEVICE=cpu GEN_PROCS=1 GEN_EXTRA="--limit 8 --max-new-tokens 16"
#   HELD_EXTRA="--limit 4 --max-new-tokens 16" TRAIN_EXTRA="--stop-after 2 --tokens-per-batch 1024 --eval-examples 4"
#   EVAL_EXTRA="--limit 2 --max-new-tokens 8" PROFILE=0 RES=/tmp/res-long DATA=/tmp/long-dry
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-/tmp/stage/target.gguf}
SHAREGPT=${SHAREGPT-/tmp/stage/sharegpt.json.gz}   # empty: the packaged ShareGPT file
DEVICE=${DEVICE:-auto}
DATA_SEED=${DATA_SEED:-0}
GEN_S=${GEN_S:-240}
GEN_PROCS=${GEN_PROCS:-4}
TEMPS=${TEMPS:-0,1,1,0.6}
MAX_NEW=${MAX_NEW:-384}
LAYERS=${LAYERS:-3}
TOKENS=${TOKENS:-8192}
STEPS=${STEPS:-40000}
LR=${LR:-6e-4}
WARMUP_FRAC=${WARMUP_FRAC:-0.01}
TRAIN_MIN=${TRAIN_MIN:-10}
INIT_FROM=${INIT_FROM:-}
PROFILE=${PROFILE:-1}
SHIPPED=${SHIPPED:-checkpoints/smollm2-135m-instruct-dspark}
EVAL_PROMPTS=${EVAL_PROMPTS:-docs/benchmarks/eval_prompts.jsonl}
RES=${RES:-/tmp/res}
DATA=${DATA:-/tmp/long}
read -r -a GEN_EXTRA <<< "${GEN_EXTRA:-}"
read -r -a HELD_EXTRA <<< "${HELD_EXTRA:---limit 256}"
read -r -a TRAIN_EXTRA <<< "${TRAIN_EXTRA:-}"
read -r -a EVAL_EXTRA <<< "${EVAL_EXTRA:-}"
SOURCE=(); [ -n "$SHAREGPT" ] && SOURCE=(--sharegpt-file "$SHAREGPT")
INIT=(); [ -n "$INIT_FROM" ] && INIT=(--init-from "$INIT_FROM")
source "$(dirname "$0")/timeline.sh"  # stamp, run

# 1. data: GEN_PROCS engine processes, each taking every GEN_PROCS-th shard (make_dataset's RANK/WORLD_SIZE split).
stamp "start data-train ($GEN_PROCS processes, ${GEN_S}s)"
for ((r = 0; r < GEN_PROCS; r++)); do
  RANK=$r WORLD_SIZE=$GEN_PROCS python -m scripts.make_dataset --out "$DATA/train" --model "$MODEL" "${SOURCE[@]}" \
    --device "$DEVICE" --temperatures "$TEMPS" --max-new-tokens "$MAX_NEW" --batch-size 512 --shard-size 512 \
    --seed "$DATA_SEED" --time-budget-s "$GEN_S" "${GEN_EXTRA[@]}" > "$RES/logs/data-train-$r.log" 2>&1 &
done
wait
stamp "end data-train"
run data-heldout python -m scripts.make_dataset --out "$DATA/heldout" --split heldout --model "$MODEL" "${SOURCE[@]}" \
  --device "$DEVICE" --temperatures 0,1 --max-new-tokens "$MAX_NEW" --batch-size 512 --shard-size 1024 \
  "${HELD_EXTRA[@]}" || exit 1
cp "$DATA/train/manifest.json" "$RES/long-data-manifest.json"

# 2. where the training step's time goes, at the batch size trained with
[ "$PROFILE" = 1 ] && run profile python -m scripts.bench_training --data "$DATA/train" --model "$MODEL" \
  --device "$DEVICE" --tokens-per-batch "$TOKENS" --num-layers "$LAYERS" --steps fast --limit 2048 \
  --json "$RES/training-step-$TOKENS.json" --profile "$RES/training-profile-$TOKENS.txt"

# 3. training, one schedule of STEPS steps across loans
run train python -m scripts.train_drafter --data "$DATA/train" --eval-data "$DATA/heldout" --eval-examples 256 \
  --model "$MODEL" --device "$DEVICE" --out "$DATA/run" --num-layers "$LAYERS" --tokens-per-batch "$TOKENS" \
  --steps "$STEPS" --lr "$LR" --warmup-frac "$WARMUP_FRAC" --time-budget-min "$TRAIN_MIN" --eval-every 1000 \
  --log-every 100 --save-every 1000 --no-resume "${INIT[@]}" "${TRAIN_EXTRA[@]}" || exit 1
mkdir -p "$RES/run"
(cd "$DATA/run" && cp -a $(ls | grep -v '^_state$') "$RES/run/")

# 4. τ on the evaluation prompts: the new drafter greedy and T = 1, the shipped one greedy (same run, same engine)
for t in 0 1; do
  run "tau-T$t" python -m scripts.eval_acceptance --drafter "$DATA/run" --prompts-file "$EVAL_PROMPTS" \
    --model "$MODEL" --device "$DEVICE" --temperature $t --max-new-tokens 256 --batch-size 60 \
    --json "$RES/long-tau-T$t.json" "${EVAL_EXTRA[@]}"
done
run tau-shipped python -m scripts.eval_acceptance --drafter "$SHIPPED" --prompts-file "$EVAL_PROMPTS" \
  --model "$MODEL" --device "$DEVICE" --temperature 0 --max-new-tokens 256 --batch-size 60 \
  --json "$RES/long-tau-shipped-T0.json" "${EVAL_EXTRA[@]}"
stamp DONE
touch "$RES/DONE"
