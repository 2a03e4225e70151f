#!/usr/bin/env bash
# Issue 3, part 2 (same warm machine as part 1): calibrate arm 1, then τ of every arm at T = 0 and T = 1 on the
# held-out chat / code / math-like prompts, all evaluations side by side on the GPU. Results to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-/tmp/stage/target.gguf}
OUT=${OUT:-/tmp/out}
NEW=${NEW:-128}
RUNS=${RUNS:-/tmp/runs}
ARMS=${ARMS:-"markov rnn parallel dflash"}
SHAREGPT=${SHAREGPT:-/tmp/stage/sharegpt.json.gz}
mkdir -p "$OUT" /tmp/eval
if [ ! -f /tmp/sd/heldout/manifest.json ]; then  # a fresh machine: regenerate the held-out set (same seed)
  python scripts/make_dataset.py --out /tmp/sd/heldout --split heldout --model "$MODEL" --sharegpt-file "$SHAREGPT" \
    --limit 256 --batch-size 256 --shard-size 256 --max-new-tokens 256 > /tmp/eval/make_heldout.log 2>&1
fi
python scripts/calibrate.py --drafter $RUNS/markov --data /tmp/sd/heldout --model "$MODEL" --max-examples 256 \
  --dump-proposals /tmp/eval/proposals > /tmp/eval/calibrate.log 2>&1 &
for a in $ARMS; do
  for t in 0 1; do
    python scripts/eval_acceptance.py --drafter $RUNS/$a --prompts-file docs/benchmarks/eval_prompts.jsonl \
      --model "$MODEL" --temperature $t --max-new-tokens "$NEW" --batch-size 60 \
      --json /tmp/eval/acceptance-$a-T$t.json > /tmp/eval/eval-$a-T$t.log 2>&1 &
  done
done
wait
tail -n 4 /tmp/eval/*.log
cp $RUNS/markov/calibration.json $RUNS/markov/reliability.png $RUNS/markov/config.json /tmp/eval/ 2>/dev/null
tar czf "$OUT/eval.tgz" -C /tmp/eval .
ls -la "$OUT"
