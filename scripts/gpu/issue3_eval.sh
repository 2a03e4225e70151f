#!/usr/bin/env bash
# Issue 3, part 2 (same warm machine as part 1): calibrate arm 1, then τ of every arm at T = 0 and T = 1 on the
# held-out chat / code / math-like prompts, all evaluations side by side on the GPU. Results to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-/tmp/stage/target.gguf}
OUT=${OUT:-/tmp/out}
NEW=${NEW:-128}
mkdir -p "$OUT" /tmp/eval
python scripts/calibrate.py --drafter /tmp/runs/markov --data /tmp/sd/heldout --model "$MODEL" --max-examples 256 \
  --dump-proposals /tmp/eval/proposals > /tmp/eval/calibrate.log 2>&1 &
for a in markov rnn parallel dflash; do
  for t in 0 1; do
    python scripts/eval_acceptance.py --drafter /tmp/runs/$a --prompts-file docs/benchmarks/eval_prompts.jsonl \
      --model "$MODEL" --temperature $t --max-new-tokens "$NEW" --batch-size 60 \
      --json /tmp/eval/acceptance-$a-T$t.json > /tmp/eval/eval-$a-T$t.log 2>&1 &
  done
done
wait
tail -n 4 /tmp/eval/*.log
cp /tmp/runs/markov/calibration.json /tmp/runs/markov/reliability.png /tmp/runs/markov/config.json /tmp/eval/ 2>/dev/null
tar czf "$OUT/eval.tgz" -C /tmp/eval .
ls -la "$OUT"
