#!/usr/bin/env bash
# Another training round on the same warm machine as scripts/gpu/session.sh (its data in /tmp/sd): arms 1, 3 and 4
# side by side on the GPU with STEPS2 steps each (same data, seed and step count), then calibration of arms 1 and 3
# and τ of all three at T = 0 and T = 1. Results in /tmp/res2 (bring back with PACK=res2 scripts/gpu/pack.sh).
#
# Side by side is not slower per arm here: on an H200 one arm alone ran at ~4 steps/s and three together at
# ~2.9 steps/s each (2026-11-29), because a step of this small drafter is bound by launches and host work, not by
# the GPU. The shipped drafters are STEPS2=1000 (about 6 minutes):
#   cd /tmp/work && STEPS2=1000 setsid nohup bash scripts/gpu/phase2.sh > /tmp/phase2.log 2>&1 &
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONPATH=/tmp/stage/site:$PWD
MODEL=${MODEL:-/tmp/stage/target.gguf}
STEPS2=${STEPS2:-700}
RES=/tmp/res2
mkdir -p $RES/logs $RES/ship $RES/runs /tmp/runs2
T0=$(date +%s)
stamp() { echo "$(date +%T) +$(($(date +%s) - T0))s $*" | tee -a $RES/timeline.txt; }
common=(--data /tmp/sd/train --model "$MODEL" --num-layers 2 --markov-rank 64 --gamma 7 --tokens-per-batch 16384
        --anchors-per-seq 32 --save-dtype bfloat16 --save-every 1000000 --log-every 10 --seed 0
        --eval-data /tmp/sd/heldout --eval-examples 128 --eval-every 250 --steps "$STEPS2" --time-budget-min 14)
stamp "phase 2: arms markov, parallel, dflash side by side, $STEPS2 steps each"
python scripts/train_drafter.py "${common[@]}" --head markov --out /tmp/runs2/markov > $RES/logs/train-markov.log 2>&1 &
python scripts/train_drafter.py "${common[@]}" --head none --out /tmp/runs2/parallel > $RES/logs/train-parallel.log 2>&1 &
python scripts/train_drafter.py "${common[@]}" --head none --loss-weights 1,0,0 --out /tmp/runs2/dflash \
  > $RES/logs/train-dflash.log 2>&1 &
wait
for arm in markov parallel dflash; do
  mkdir -p $RES/runs/$arm && cp /tmp/runs2/$arm/{summary.json,metrics.jsonl,README.md} $RES/runs/$arm/
  stamp "trained $arm: $(tail -n 1 $RES/logs/train-$arm.log | cut -c1-150)"
done
for arm in markov parallel; do
  python scripts/calibrate.py --drafter /tmp/runs2/$arm --data /tmp/sd/heldout --model "$MODEL" \
    --dump-proposals $RES/proposals-$arm > $RES/logs/calibrate-$arm.log 2>&1 &
done
wait
stamp "calibrated: $(grep -h 'held-out ECE' $RES/logs/calibrate-*.log | cut -c1-160 | tr '\n' ' ')"
for arm in markov parallel dflash; do
  for t in 0 1; do
    python scripts/eval_acceptance.py --drafter /tmp/runs2/$arm --prompts-file docs/benchmarks/eval_prompts.jsonl \
      --model "$MODEL" --temperature $t --max-new-tokens 128 --batch-size 60 \
      --json $RES/acceptance-$arm-T$t.json > $RES/logs/eval-$arm-T$t.log 2>&1 &
  done
done
wait
for arm in markov parallel; do
  name=smollm2-135m-instruct-$([ $arm = markov ] && echo dspark || echo parallel)
  mkdir -p $RES/ship/$name && (cd /tmp/runs2/$arm && cp -a $(ls | grep -v '^_state$') $RES/ship/$name/)
done
stamp "evaluated: $(for f in $RES/acceptance-*.json; do python -c "import json,sys;print(sys.argv[1].split('/')[-1], json.load(open(sys.argv[1]))['mean_accepted_length'])" $f; done | tr '\n' ' ')"
stamp "DONE"
touch $RES/DONE
