#!/usr/bin/env bash
# Reproduces the shipped SmolLM2 drafter and its published numbers on one H200 (~22 min):
#   1. self-distillation data with the engine: every ShareGPT training prompt answered greedily, twice at T = 1 and
#      at T = 0.6
#      (GEN_S seconds; rerunning resumes), and the held-out split for evaluation and calibration;
#   2. docs/benchmarks/training-h200.json: the fast training step against the reference step, same batches;
#   3. training on every response position with the fused loss, schedule over TRAIN_MIN minutes;
#   4. calibration (STS + per-slot bias) on ≥ 10k held-out proposals per decoding mode;
#   5. τ per domain and per slot on docs/benchmarks/eval_prompts.jsonl, greedy and T = 1, through the engine;
#   6. the engine benchmark with the new drafter.
# Needs the target at $MODEL and ShareGPT at $SHAREGPT (docs/training.md, "Reproduction scripts on a GPU machine").
# Results go to $RES (default /tmp/res); `bash scripts/reproduce/pack.sh` packs them into ≤ 15 MB parts.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-/tmp/stage/target.gguf}
SHAREGPT=${SHAREGPT:-/tmp/stage/sharegpt.json.gz}
GEN_S=${GEN_S:-300}
# Greedy, twice T = 1 (two samples per prompt: different request ids) and T = 0.6: ~4 responses per prompt to reach
# ~15-20 M response tokens from the ~12k English ShareGPT training prompts.
TEMPS=${TEMPS:-0,1,1,0.6}
TRAIN_MIN=${TRAIN_MIN:-9}
RES=${RES:-/tmp/res}
DATA=${DATA:-/tmp/sd}
RUN=${RUN:-/tmp/runs/dspark}
EVAL_PROMPTS=${EVAL_PROMPTS:-docs/benchmarks/eval_prompts.jsonl}
EVAL_TOKENS=${EVAL_TOKENS:-256}
BENCH_ENGINE=${BENCH_ENGINE:-1}
read -r -a TRAIN_EXTRA <<< "${TRAIN_EXTRA:-}"
read -r -a GEN_EXTRA <<< "${GEN_EXTRA:-}"   # e.g. "--limit 16 --max-new-tokens 32" for a CPU dry run
read -r -a BENCH_EXTRA <<< "${BENCH_EXTRA:-}"
mkdir -p "$RES/logs" "$RES/ship"
T0=$(date +%s)
stamp() { echo "$(date +%T) +$(($(date +%s) - T0))s $*" | tee -a "$RES/timeline.txt"; }
run() { local name=$1; shift; stamp "start $name"; "$@" > "$RES/logs/$name.log" 2>&1; stamp "end $name rc=$?"; }

run data-train python -m scripts.make_dataset --out "$DATA/train" --model "$MODEL" --sharegpt-file "$SHAREGPT" \
  --temperatures "$TEMPS" --batch-size 512 --shard-size 1024 --max-new-tokens 512 --time-budget-s "$GEN_S" "${GEN_EXTRA[@]}"
run data-heldout python -m scripts.make_dataset --out "$DATA/heldout" --split heldout --model "$MODEL" \
  --sharegpt-file "$SHAREGPT" --temperatures 0,1 --batch-size 512 --shard-size 1024 --max-new-tokens 512 \
  "${GEN_EXTRA[@]}"
cp "$DATA/train/manifest.json" "$RES/data-train-manifest.json"; cp "$DATA/heldout/manifest.json" "$RES/data-heldout-manifest.json"
run bench-training python -m scripts.bench_training --data "$DATA/train" --model "$MODEL" \
  --json "$RES/training-h200.json" "${BENCH_EXTRA[@]}"
run train python -m scripts.train_drafter --data "$DATA/train" --eval-data "$DATA/heldout" --eval-examples 256 \
  --model "$MODEL" --out "$RUN" --steps 0 --time-budget-min "$TRAIN_MIN" --eval-every 1000 --log-every 50 \
  "${TRAIN_EXTRA[@]}"
run calibrate python -m scripts.calibrate --drafter "$RUN" --data "$DATA/heldout" --model "$MODEL" --anchors-per-seq 24
for t in 0 1; do
  run "tau-T$t" python -m scripts.eval_acceptance --drafter "$RUN" --prompts-file "$EVAL_PROMPTS" \
    --model "$MODEL" --temperature $t --max-new-tokens "$EVAL_TOKENS" --batch-size 60 --json "$RES/acceptance-T$t.json"
done
(cd "$RUN" && cp -a $(ls | grep -v '^_state$') "$RES/ship/")
stamp "drafter shipped to $RES/ship"
[ "$BENCH_ENGINE" = 1 ] && run bench-engine python scripts/bench_engine.py --model "$MODEL" --sharegpt-file "$SHAREGPT" --drafter "$RUN" \
  --modes none,fixed:3,fixed:7,dsd,adaptive --repeats 2 --time-budget-s 200 --out "$RES/engine-h200.json"
stamp DONE
touch "$RES/DONE"
