#!/usr/bin/env bash
# Issue 3, part 1 on one lent H200: self-distilled data, then the four arms trained side by side on the GPU.
# Run from the repo root after the model and ShareGPT were staged (../shared/gpu/README.md):
#   bash scripts/gpu/issue3_train.sh           (GEN_S, HELD_S, TRAIN_MIN override the time budgets)
# Leaves data in /tmp/sd and checkpoints in /tmp/runs; packs logs + arms 1 and 3 into $OUT as 15 MB parts.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-/tmp/stage/target.gguf}
SHAREGPT=${SHAREGPT:-/tmp/stage/sharegpt.json.gz}
GEN_S=${GEN_S:-165}
HELD_S=${HELD_S:-45}
TRAIN_MIN=${TRAIN_MIN:-4.5}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/sd /tmp/runs
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

# 1. Self-distillation: the target answers ShareGPT prompts (temperature 0.2, top-p 0.9). A cut run keeps its
#    finished shards (the manifest then says complete: false).
timeout "$GEN_S" python scripts/make_dataset.py --out /tmp/sd/train --model "$MODEL" --sharegpt-file "$SHAREGPT" \
  --limit 12288 --batch-size 1024 --shard-size 1024 --max-new-tokens 256 2>&1 | tail -n 40 > "$OUT/make_train.log"
timeout "$HELD_S" python scripts/make_dataset.py --out /tmp/sd/heldout --split heldout --model "$MODEL" \
  --sharegpt-file "$SHAREGPT" --limit 512 --batch-size 512 --shard-size 256 --max-new-tokens 256 2>&1 \
  | tail -n 20 > "$OUT/make_heldout.log"

# 2. Four arms, same data / seed / schedule, side by side (each is small next to the H200).
common=(--data /tmp/sd/train --eval-data /tmp/sd/heldout --eval-examples 128 --model "$MODEL" --num-layers 2
        --markov-rank 64 --gamma 7 --tokens-per-batch 16384 --anchors-per-seq 32 --steps 0
        --time-budget-min "$TRAIN_MIN" --save-dtype bfloat16 --eval-every 250 --save-every 1000000 --log-every 25)
python scripts/train_drafter.py "${common[@]}" --head markov --out /tmp/runs/markov > /tmp/runs/markov.log 2>&1 &
python scripts/train_drafter.py "${common[@]}" --head rnn --out /tmp/runs/rnn > /tmp/runs/rnn.log 2>&1 &
python scripts/train_drafter.py "${common[@]}" --head none --out /tmp/runs/parallel > /tmp/runs/parallel.log 2>&1 &
python scripts/train_drafter.py "${common[@]}" --head none --loss-weights 1,0,0 --out /tmp/runs/dflash \
  > /tmp/runs/dflash.log 2>&1 &
wait
for a in markov rnn parallel dflash; do tail -n 5 /tmp/runs/$a.log; done

# 3. Bring back: logs, summaries, metrics of all arms; weights of arms 1 (markov) and 3 (parallel).
tar czf /tmp/bundle.tgz -C /tmp/runs --exclude=_state markov parallel rnn/summary.json rnn/metrics.jsonl \
  dflash/summary.json dflash/metrics.jsonl markov.log rnn.log parallel.log dflash.log \
  -C /tmp/sd train/manifest.json heldout/manifest.json
split -b 15000000 /tmp/bundle.tgz "$OUT/bundle.tgz.part-"
ls -la "$OUT"
