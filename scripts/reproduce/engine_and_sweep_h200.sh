#!/usr/bin/env bash
# The engine results and the backbone-depth / Markov-rank sweep on one H200 (≈ 24 min), in the order that keeps
# timings clean:
#   1. the engine, timed: profiles (fused vs unfused layer ops), kernels, engine benchmark — alone on the GPU
#      (scripts/reproduce/engine_h200.sh PARTS=timed, results in /tmp/res);
#   2. drafter data: self-distillation on as many ShareGPT prompts as GEN_S allows, and a larger held-out set
#      (HELD_N) so calibration has ~10k proposals per half — while the engine's timing-free checks (GPU equivalence
#      of the remaining modes, gpu-marked tests) share the GPU;
#   3. drafter arms side by side (scripts/reproduce/drafter_arms_h200.sh, results in /tmp/res2): the Markov default
#      against the CE-only arm on the larger data, plus the backbone-depth and Markov-rank sweep; calibration with 32
#      proposals per held-out sequence; τ of every arm at T = 0 and T = 1.
# Run with the target and ShareGPT staged under /tmp/stage on a copy of the repo, in the background; collect with
#   PACK="res res2" OUT=$OUT bash scripts/reproduce/pack_results.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=/tmp/stage/site:$PWD
MODEL=${MODEL:-/tmp/stage/target.gguf}
SHAREGPT=${SHAREGPT:-/tmp/stage/sharegpt.json.gz}
GEN_S=${GEN_S:-210}       # seconds of training-data generation (resumable: rerun to add shards)
HELD_N=${HELD_N:-768}     # held-out sequences (training eval, calibration, proposals)
read -r -a GEN_EXTRA <<< "${GEN_EXTRA:-}"
RES=/tmp/res
mkdir -p $RES/logs
T0=$(date +%s)
stamp() { echo "$(date +%T) +$(($(date +%s) - T0))s $*" | tee -a $RES/timeline.txt; }

PARTS=timed bash scripts/reproduce/engine_h200.sh
stamp "engine timings done"
PARTS=checks bash scripts/reproduce/engine_h200.sh > $RES/logs/checks.log 2>&1 &
checks=$!
python scripts/make_dataset.py --out /tmp/sd/train --model "$MODEL" --sharegpt-file "$SHAREGPT" --batch-size 1024 \
  --shard-size 1024 --max-new-tokens 256 --time-budget-s "$GEN_S" "${GEN_EXTRA[@]}" > $RES/logs/make_train.log 2>&1
stamp "train data: $(python -c "import json;m=json.load(open('/tmp/sd/train/manifest.json'));print(m['examples'],'seqs',m['response_tokens'],'response tokens')")"
python scripts/make_dataset.py --out /tmp/sd/heldout --split heldout --model "$MODEL" --sharegpt-file "$SHAREGPT" \
  --limit "$HELD_N" --batch-size "$HELD_N" --shard-size 256 --max-new-tokens 256 "${GEN_EXTRA[@]}" \
  > $RES/logs/make_heldout.log 2>&1
stamp "held-out data: $(python -c "import json;m=json.load(open('/tmp/sd/heldout/manifest.json'));print(m['examples'],'seqs')")"
cp /tmp/sd/train/manifest.json $RES/train-manifest.json; cp /tmp/sd/heldout/manifest.json $RES/heldout-manifest.json

# Arms: the shipped configuration (2 layers, rank 64), the paper's DFlash arm (parallel, CE only), and the sweep.
ARMS=${ARMS:-"markov=--head markov;dflash=--head none --loss-weights 1,0,0;l1=--head markov --num-layers 1;\
l3=--head markov --num-layers 3;r128=--head markov --markov-rank 128"} \
SHIP=${SHIP-"markov:smollm2-135m-instruct-dspark"} STEPS2=${STEPS2:-800} \
TRAIN_EXTRA="--time-budget-min ${TRAIN_MIN:-7} ${TRAIN_EXTRA:-}" CAL_EXTRA="--anchors-per-seq 32 ${CAL_EXTRA:-}" \
  bash scripts/reproduce/drafter_arms_h200.sh
stamp "drafter arms done"
wait $checks
stamp "checks done"
stamp "DONE"
touch $RES/DONE
