#!/usr/bin/env bash
# The drafter arms side by side on one H200 (docs/benchmarks/training.json, acceptance.json, calibration*.json and the
# shipped checkpoints), on the data scripts/reproduce/drafters_h200.sh generated (/tmp/sd): several arms with STEPS2
# steps each (same data, seed and step count), then STS calibration of the arms to ship and τ of every arm at T = 0
# and T = 1. Results in $RES (bring back with PACK=res2 scripts/reproduce/pack_results.sh).
#
# Side by side is not slower per arm here: on an H200 one arm alone ran at ~4 steps/s and three together at
# ~2.9 steps/s each (2026-11-29), because a step of this small drafter is bound by launches and host work, not by
# the GPU. The shipped drafters are the default ARMS with STEPS2=1000 (about 6 minutes):
#   cd /tmp/work && STEPS2=1000 setsid nohup bash scripts/reproduce/drafter_arms_h200.sh > /tmp/arms.log 2>&1 &
#
# ARMS is a ';'-separated list of NAME=TRAIN_DRAFTER_ARGS (each run gets the common arguments below first, so an
# arm's own arguments override them). A backbone-depth / Markov-rank sweep, for example:
#   ARMS="l1=--head markov --num-layers 1;l2=--head markov;l3=--head markov --num-layers 3;\
#   r32=--head markov --markov-rank 32;r128=--head markov --markov-rank 128" SHIP="" \
#   bash scripts/reproduce/drafter_arms_h200.sh
# SHIP lists NAME:CHECKPOINT_NAME pairs to calibrate and copy to $RES/ship (empty: calibrate nothing).
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONPATH=/tmp/stage/site:$PWD
MODEL=${MODEL:-/tmp/stage/target.gguf}
STEPS2=${STEPS2:-700}
DATA=${DATA:-/tmp/sd/train}
HELDOUT=${HELDOUT:-/tmp/sd/heldout}
RES=${RES:-/tmp/res2}
RUNS=${RUNS:-/tmp/runs2}
ARMS=${ARMS:-"markov=--head markov;parallel=--head none;dflash=--head none --loss-weights 1,0,0"}
SHIP=${SHIP-"markov:smollm2-135m-instruct-dspark parallel:smollm2-135m-instruct-parallel"}
read -r -a EVAL_EXTRA <<< "${EVAL_EXTRA:-}"    # appended to eval_acceptance.py (argparse keeps the last value)
read -r -a TRAIN_EXTRA <<< "${TRAIN_EXTRA:-}"  # appended to every train_drafter.py (e.g. a CPU dry run's sizes)
read -r -a CAL_EXTRA <<< "${CAL_EXTRA:-}"      # appended to calibrate.py
mkdir -p $RES/logs $RES/ship $RES/runs $RUNS
T0=$(date +%s)
stamp() { echo "$(date +%T) +$(($(date +%s) - T0))s $*" | tee -a $RES/timeline.txt; }
common=(--data "$DATA" --model "$MODEL" --num-layers 2 --markov-rank 64 --gamma 7 --tokens-per-batch 16384
        --anchors-per-seq 32 --save-dtype bfloat16 --save-every 1000000 --log-every 10 --seed 0
        --eval-data "$HELDOUT" --eval-examples 128 --eval-every 250 --steps "$STEPS2" --time-budget-min 14)
IFS=';' read -r -a specs <<< "$ARMS"
names=()
stamp "arms side by side, $STEPS2 steps each: $ARMS"
for spec in "${specs[@]}"; do
  name=${spec%%=*}
  read -r -a own <<< "${spec#*=}"
  names+=("$name")
  python scripts/train_drafter.py "${common[@]}" "${own[@]}" "${TRAIN_EXTRA[@]}" --out $RUNS/$name > $RES/logs/train-$name.log 2>&1 &
done
wait
for name in "${names[@]}"; do
  mkdir -p $RES/runs/$name && cp $RUNS/$name/{summary.json,metrics.jsonl,README.md} $RES/runs/$name/
  stamp "trained $name: $(tail -n 1 $RES/logs/train-$name.log | cut -c1-150)"
done
for pair in $SHIP; do
  python scripts/calibrate.py --drafter $RUNS/${pair%%:*} --data "$HELDOUT" --model "$MODEL" \
    --dump-proposals $RES/proposals-${pair%%:*} "${CAL_EXTRA[@]}" > $RES/logs/calibrate-${pair%%:*}.log 2>&1 &
done
wait
[ -n "$SHIP" ] && stamp "calibrated: $(grep -h 'held-out ECE' $RES/logs/calibrate-*.log | cut -c1-160 | tr '\n' ' ')"
for name in "${names[@]}"; do
  for t in 0 1; do
    python scripts/eval_acceptance.py --drafter $RUNS/$name --prompts-file docs/benchmarks/eval_prompts.jsonl \
      --model "$MODEL" --temperature $t --max-new-tokens 128 --batch-size 60 \
      --json $RES/acceptance-$name-T$t.json "${EVAL_EXTRA[@]}" > $RES/logs/eval-$name-T$t.log 2>&1 &
  done
done
wait
for pair in $SHIP; do
  mkdir -p $RES/ship/${pair#*:} && (cd $RUNS/${pair%%:*} && cp -a $(ls | grep -v '^_state$') $RES/ship/${pair#*:}/)
done
stamp "evaluated: $(for f in $RES/acceptance-*.json; do python -c "import json,sys;print(sys.argv[1].split('/')[-1], json.load(open(sys.argv[1]))['mean_accepted_length'])" $f; done | tr '\n' ' ')"
stamp "DONE"
touch $RES/DONE
