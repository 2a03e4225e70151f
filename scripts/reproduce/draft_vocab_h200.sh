#!/usr/bin/env bash
# A draft vocabulary for the shipped drafter (scripts/draft_vocab.py) and what it changes, on one H200:
#
#   1. the draft-vocabulary GPU tests (every draft-head kernel variant and the engine end to end, compiled for sm_90)
#   2. self-distilled responses of the target on training prompts (1,536 ShareGPT train-split prompts, greedy and
#      T = 1, 256 tokens) and on held-out prompts (256, greedy): the token counts the vocabulary is chosen from, and
#      its held-out coverage
#   3. drafters restricted to the 8,192 / 16,384 / 32,768 most frequent ids (draft-vocab.json: coverage per size)
#   4. τ on docs/benchmarks/eval_prompts.jsonl (60 prompts, 256 tokens, fixed K = 7) of the full and the restricted
#      drafters, greedy and T = 1; the hybrid proposer with the full drafter
#   5. the engine benchmark in closed batches with the 16,384-id drafter and with the full one, same modes
#
# Needs the target at $MODEL and ShareGPT at $SHAREGPT (docs/training.md, "Reproduction scripts on a GPU machine").
# Run it on a copy of the repository; `bash scripts/reproduce/pack.sh` packs $RES for the trip back.
set -uo pipefail
source "$(dirname "$0")/staged.sh"  # environment, MODEL, SHAREGPT, DRAFTER, RES, SRC, GPU; stamp, run
WORK=${WORK:-/tmp/vocab}
mkdir -p "$WORK"
EVAL=(--model "$MODEL" --prompts-file docs/benchmarks/eval_prompts.jsonl --max-new-tokens 256)
MODES=none,none+async,fixed:7,fixed:7+async,adaptive,adaptive+async

run cache python -c "from reference.target import Target; Target.load('$MODEL')"
run tests timeout 200 python -m pytest -q -p no:cacheprovider tests/equivalence/test_draft_head.py \
  tests/equivalence/test_end_to_end.py -k "draft_vocab"
run data-train timeout 150 python -m scripts.make_dataset --out "$WORK/train" --model "$MODEL" --split train \
  --sharegpt-file "$SHAREGPT" --limit 1536 --max-new-tokens 256 --temperatures 0,1 --batch-size 512
run data-heldout timeout 60 python -m scripts.make_dataset --out "$WORK/heldout" --model "$MODEL" --split heldout \
  --sharegpt-file "$SHAREGPT" --limit 256 --max-new-tokens 256 --temperatures 0 --batch-size 256
for size in 16384 8192 32768; do
  run "vocab-$size" python -m scripts.draft_vocab --data "$WORK/train" --heldout-data "$WORK/heldout" \
    --size "$size" --drafter "$DRAFTER" --out "$WORK/vd$size" --json "$RES/draft-vocab-$size.json"
done
for d in full:"$DRAFTER" vd16384:"$WORK/vd16384" vd8192:"$WORK/vd8192" vd32768:"$WORK/vd32768"; do
  run "tau-${d%%:*}-t0" timeout 120 python -m scripts.eval_acceptance "${EVAL[@]}" --drafter "${d#*:}" \
    --temperature 0 --json "$RES/tau-${d%%:*}-t0.json"
done
for d in full:"$DRAFTER" vd16384:"$WORK/vd16384"; do
  run "tau-${d%%:*}-t1" timeout 120 python -m scripts.eval_acceptance "${EVAL[@]}" --drafter "${d#*:}" \
    --temperature 1 --seeds 2 --json "$RES/tau-${d%%:*}-t1.json"
done
run tau-hybrid-t0 timeout 120 python -m scripts.eval_acceptance "${EVAL[@]}" --drafter "$DRAFTER" --proposer hybrid \
  --temperature 0 --json "$RES/tau-hybrid-t0.json"
run tau-ngram-t0 timeout 120 python -m scripts.eval_acceptance "${EVAL[@]}" --proposer ngram \
  --temperature 0 --json "$RES/tau-ngram-t0.json"
for d in vd16384:"$WORK/vd16384" full:"$DRAFTER"; do
  run "bench-${d%%:*}" timeout 260 python -m scripts.bench_engine --model "$MODEL" --drafter "${d#*:}" \
    --sharegpt-file "$SHAREGPT" --modes "$MODES" --batch-sizes 1,4,16,64,256 --min-requests 16 --hf-max-batch 0 \
    --repeats 2 --time-budget-s 210 --out "$RES/engine-h200-${d%%:*}.json"
done
cp -r "$WORK/vd16384" "$RES/vd16384-checkpoint-config" 2>/dev/null && rm -f "$RES"/vd16384-checkpoint-config/*.safetensors
stamp DONE
touch "$RES/DONE"
