#!/usr/bin/env bash
# One GPU loan of the drafter's long training on one H200 (~25 min). The drafter needs tens of thousands of optimizer
# steps and a loan gives a few thousand, so one learning-rate schedule (--steps STEPS) spans several loans: each loan
#   1. regenerates self-distillation data with the engine, GEN_PROCS processes sharing the GPU for GEN_S seconds
#      (deterministic from DATA_SEED; START_SHARD makes a loan answer first the prompts an earlier loan did not
#      reach), and the held-out set (the trainer's curve reads 256 of it, the calibration all of it);
#   2. profiles the training step (scripts/bench_training.py --profile) at the batch size it trains with (PROFILE=1),
#      checks the loss kernel on this GPU (the torch loss if its test fails) and picks the backbone's attention
#      (ATTENTION=measure: FlexAttention if its GPU test passes and it is faster);
#   3. trains for TRAIN_MIN minutes from INIT_FROM (default: the shipped drafter, which records its step, so the
#      schedule continues where the last loan stopped; INIT_FROM= starts a new schedule from scratch), annealing the
#      learning rate to 0 over the last ANNEAL_FRAC of them, so every loan ships an annealed drafter (the next loan
#      re-warms and continues the cosine of STEPS underneath);
#   4. calibrates the new drafter (STS + per-slot bias, written into its config.json; its proposals are kept in
#      $RES/proposals for scripts/compare_calibration.py) and measures τ on
#      docs/benchmarks/eval_prompts.jsonl, greedy and T = 1, with the drafter it replaces measured greedily in the
#      same run (the baseline); T = 1 pooled over T1_SEEDS seeds (2), the replaced drafter at T = 1 too;
#   5. runs the engine benchmark with it at batch 1, 16 and 64 (ENGINE=1): closed batches, then (STEADY=1) a server's
#      steady state (--requests-per-slot 4, request lengths varied by --output-len-spread 0.5) with the pipelining
#      switches beside the plain modes (+async, +ahead);
#   6. leaves the checkpoint (SAVE_WEIGHTS, int8 by default; shards ≤ 15 MB) in $RES/run for the trip back
#      (scripts/reproduce/pack.sh).
# Pass the same STEPS, LR and TOKENS on every loan of one schedule; LAYERS may grow (a deeper LAYERS than INIT_FROM's
# deepens it: the new layers start as the identity, DSparkDrafter.deepened). The shipped schedule so far: loan 1 (from
# scratch, DATA_SEED=0, prompt shards 0-19, 10 min, einsum attention), loan 2 (DATA_SEED=1 START_SHARD=20, which
# reached shards 20-27 and 0-7, TRAIN_MIN=11, FlexAttention), loan 3 (DATA_SEED=2 START_SHARD=8 TRAIN_MIN=13
# ATTENTION=flex PROFILE=0: shards 8-19, 21 and 22, steps 7,253-12,938; the whole script took 23 minutes), loan 4
# (DATA_SEED=3 START_SHARD=20, the same settings: shards 20-27 and 0-7, steps 12,938-19,126; 24 minutes with the
# steady-state benchmark), loan 5 (LAYERS=5 DATA_SEED=4 START_SHARD=8 TRAIN_MIN=12, the 3 layers deepened to 5, saved
# in bfloat16 and stored in int8 afterwards with scripts/quantize_drafter.py: steps 19,126-23,670, data from every
# shard but 4-6, with prompt graphs; 23 minutes), loan 6 (LAYERS=5 DATA_SEED=5 START_SHARD=4 GEN_S=210 TRAIN_MIN=7
# ENGINE=0, a short loan followed by serving_h200.sh: shards 4-23, steps 23,670-26,335; 14 minutes), loan 7 (LAYERS=5
# DATA_SEED=6 START_SHARD=24 GEN_S=210 TRAIN_MIN=10 ENGINE=0 TRAIN_EXTRA="--loss-weights 0,0.5,1,1": shards 24-27 and
# 0-15, steps 26,335-30,055, the L1 term added), loan 8 (LAYERS=5 DATA_SEED=7 START_SHARD=16 GEN_S=210 TRAIN_MIN=11
# ATTENTION=flex PROFILE=0 ENGINE=1 STEADY=0 TRAIN_EXTRA="--loss-weights 0,1,1,1": shards 16-27, 0-11 and 15, steps
# 30,055-34,274, the L1 weight raised to 1; 20 minutes), loan 9 (LAYERS=5 DATA_SEED=8 START_SHARD=12 GEN_S=210
# TRAIN_MIN=16 ATTENTION=flex PROFILE=0 ENGINE=0 TRAIN_EXTRA="--loss-weights 0,1,1,1": shards 12-27 and 0-7, steps
# 34,274-40,000, the schedule's end, reached after 14 of the 16 minutes; 21 minutes in all). A new schedule (a wider or
# deeper drafter, say) starts from scratch with INIT_FROM= and its own STEPS.
# Needs the target at $MODEL and ShareGPT at $SHAREGPT (docs/training.md, "Reproduction scripts on a GPU machine").
# A CPU dry run: MODEL=smollm2-135m-instruct SHAREGPT= DEVICE=cpu GEN_PROCS=1 GEN_EXTRA="--limit 8 --max-new-tokens 16"
#   HELD_EXTRA="--limit 8 --max-new-tokens 16" TRAIN_EXTRA="--stop-after 2 --eval-examples 4" TOKENS=1024
#   EVAL_EXTRA="--limit 2 --max-new-tokens 8" CAL_EXTRA="--anchors-per-seq 2" PROFILE=0 ENGINE=0 ATTENTION=einsum INIT_FROM=
#   RES=/tmp/res-long DATA=/tmp/long-dry
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-/tmp/stage/target.gguf}
SHAREGPT=${SHAREGPT-/tmp/stage/sharegpt.json.gz}   # empty: the packaged ShareGPT file
DEVICE=${DEVICE:-auto}
DATA_SEED=${DATA_SEED:-0}
START_SHARD=${START_SHARD:-0}
GEN_S=${GEN_S:-240}
GEN_PROCS=${GEN_PROCS:-4}
TEMPS=${TEMPS:-0,1,1,0.6}
MAX_NEW=${MAX_NEW:-384}
LAYERS=${LAYERS:-5}
SAVE_WEIGHTS=${SAVE_WEIGHTS:-int8}   # the checkpoint's storage (reference.checkpoint): int8 keeps 5 layers under 25 MB
TOKENS=${TOKENS:-8192}
STEPS=${STEPS:-40000}
LR=${LR:-6e-4}
WARMUP_FRAC=${WARMUP_FRAC:-0.01}
TRAIN_MIN=${TRAIN_MIN:-12}
ANNEAL_FRAC=${ANNEAL_FRAC:-0.4}   # the last 40 % of the loan's training anneals the learning rate to 0
INIT_FROM=${INIT_FROM-checkpoints/smollm2-135m-instruct-dspark}   # empty: a new schedule from scratch
PROFILE=${PROFILE:-1}
ENGINE=${ENGINE:-1}
STEADY=${STEADY:-1}
STEADY_S=${STEADY_S:-90}
ATTENTION=${ATTENTION:-measure}   # einsum | flex | measure (step 2 decides)
SHIPPED=${SHIPPED:-checkpoints/smollm2-135m-instruct-dspark}
EVAL_PROMPTS=${EVAL_PROMPTS:-docs/benchmarks/eval_prompts.jsonl}
RES=${RES:-/tmp/res}
DATA=${DATA:-/tmp/long}
read -r -a GEN_EXTRA <<< "${GEN_EXTRA:-}"
read -r -a HELD_EXTRA <<< "${HELD_EXTRA:-}"
read -r -a CAL_EXTRA <<< "${CAL_EXTRA:---anchors-per-seq 32}"  # each mode on its own half of the held-out set: ≥ 14k proposals
read -r -a TRAIN_EXTRA <<< "${TRAIN_EXTRA:-}"
read -r -a EVAL_EXTRA <<< "${EVAL_EXTRA:-}"
SOURCE=(); [ -n "$SHAREGPT" ] && SOURCE=(--sharegpt-file "$SHAREGPT")
INIT=(); [ -n "$INIT_FROM" ] && INIT=(--init-from "$INIT_FROM")
source "$(dirname "$0")/timeline.sh"  # stamp, run
source "$(dirname "$0")/data.sh"  # self_distill_data

# 1. data (scripts/reproduce/data.sh), answering first the shards from START_SHARD on
self_distill_data --start-shard "$START_SHARD" || exit 1
cp "$DATA/train/manifest.json" "$RES/long-data-manifest.json"

# 2. where the training step's time goes, at the batch size trained with; and, with ATTENTION=measure, whether the
#    backbone's FlexAttention variant is right on this GPU (its gradient test) and faster (its own benchmark): the
#    training then uses it only if both hold
[ "$PROFILE" = 1 ] && run profile python -m scripts.bench_training --data "$DATA/train" --model "$MODEL" \
  --device "$DEVICE" --tokens-per-batch "$TOKENS" --num-layers "$LAYERS" --steps fast --limit 2048 \
  --json "$RES/training-step-$TOKENS.json" --profile "$RES/training-profile-$TOKENS.txt"
LOSS_BACKEND=auto   # the Triton loss kernel, unless its GPU test fails here
run loss-kernel-tests python -m pytest -q tests/equivalence/test_distill_loss.py || LOSS_BACKEND=torch
if [ "$ATTENTION" = measure ]; then
  ATTENTION=einsum
  if run flex-tests python -m pytest -q tests/equivalence/test_training.py -k "flex" &&
     run flex-bench python -m scripts.bench_training --data "$DATA/train" --model "$MODEL" --device "$DEVICE" \
       --tokens-per-batch "$TOKENS" --num-layers "$LAYERS" --steps fast,fast-flex --limit 2048 \
       --json "$RES/training-flex-$TOKENS.json"; then
    ATTENTION=$(python -c "import json, sys; r = {x['step']: x['slot_predictions_per_s'] for x in
json.load(open(sys.argv[1]))['results']}; print('flex' if r['fast-flex'] > 1.05 * r['fast'] else 'einsum')" \
      "$RES/training-flex-$TOKENS.json")
  fi
  stamp "attention: $ATTENTION"
fi

# 3. training, one schedule of STEPS steps across loans
run train python -m scripts.train_drafter --data "$DATA/train" --eval-data "$DATA/heldout" --eval-examples 256 \
  --model "$MODEL" --device "$DEVICE" --out "$DATA/run" --num-layers "$LAYERS" --tokens-per-batch "$TOKENS" \
  --steps "$STEPS" --lr "$LR" --warmup-frac "$WARMUP_FRAC" --time-budget-min "$TRAIN_MIN" --anneal-frac "$ANNEAL_FRAC" --eval-every 1000 \
  --log-every 100 --save-every 1000 --attention "$ATTENTION" --loss-backend "$LOSS_BACKEND" --no-resume "${INIT[@]}" \
  --save-weights "$SAVE_WEIGHTS" \
  "${TRAIN_EXTRA[@]}" || exit 1

# 4. calibration (into the checkpoint's config.json), then τ on the evaluation prompts: the new drafter greedy and
#    T = 1, the one it replaces greedy (same run, same engine)
run calibrate python -m scripts.calibrate --drafter "$DATA/run" --data "$DATA/heldout" --model "$MODEL" \
  --device "$DEVICE" --json "$RES/calibration.json" --plot "$RES/calibration-reliability.png" \
  --dump-proposals "$RES/proposals" "${CAL_EXTRA[@]}"
mkdir -p "$RES/run"
(cd "$DATA/run" && cp -a $(ls | grep -v '^_state$') "$RES/run/")
for t in 0 1; do
  SEEDS=1; [ $t = 1 ] && SEEDS=${T1_SEEDS:-2}  # sampled τ: pooled over seeds (its standard error shrinks by √N)
  run "tau-T$t" python -m scripts.eval_acceptance --drafter "$DATA/run" --prompts-file "$EVAL_PROMPTS" \
    --model "$MODEL" --device "$DEVICE" --temperature $t --max-new-tokens 256 --batch-size 60 --seeds $SEEDS \
    --json "$RES/long-tau-T$t.json" "${EVAL_EXTRA[@]}"
done
run tau-shipped python -m scripts.eval_acceptance --drafter "$SHIPPED" --prompts-file "$EVAL_PROMPTS" \
  --model "$MODEL" --device "$DEVICE" --temperature 0 --max-new-tokens 256 --batch-size 60 \
  --json "$RES/long-tau-shipped-T0.json" "${EVAL_EXTRA[@]}"
run tau-shipped-T1 python -m scripts.eval_acceptance --drafter "$SHIPPED" --prompts-file "$EVAL_PROMPTS" \
  --model "$MODEL" --device "$DEVICE" --temperature 1 --max-new-tokens 256 --batch-size 60 --seeds "${T1_SEEDS:-2}" \
  --json "$RES/long-tau-shipped-T1.json" "${EVAL_EXTRA[@]}"

# 5. the engine with the new drafter against plain decoding and fixed K (at least 16 requests at every batch size:
#    batch 1 runs 16 prompts one after another, not one prompt)
[ "$ENGINE" = 1 ] && run bench-engine python scripts/bench_engine.py --model "$MODEL" "${SOURCE[@]}" \
  --drafter "$DATA/run" --modes none,fixed:3,fixed:7,adaptive --batch-sizes 1,16,64 --min-requests 16 --repeats 2 \
  --time-budget-s 150 --out "$RES/engine-h200-shipped.json"
# A server's steady state with request lengths varied (--output-len-spread): equal lengths would let plain decoding
# refill its slots in lockstep while speculative requests admit a prompt nearly every step.
[ "$ENGINE" = 1 ] && [ "$STEADY" = 1 ] && run bench-engine-steady python scripts/bench_engine.py --model "$MODEL" \
  "${SOURCE[@]}" --drafter "$DATA/run" --modes none,none+async,fixed:7,adaptive,adaptive+ahead --batch-sizes 1,16,64 \
  --requests-per-slot 4 --output-len-spread 0.5 --repeats 2 --hf-max-batch 0 --time-budget-s "$STEADY_S" \
  --out "$RES/engine-h200-steady-varied.json"
stamp DONE
touch "$RES/DONE"
