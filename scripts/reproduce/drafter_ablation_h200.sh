#!/usr/bin/env bash
# The sequential head's worth on one H200 (~20 min): DSpark (Markov head) against the parallel-only drafter (no
# sequential head, DFlash's shape) at equal data, size and optimizer steps, trained with the dense trainer from
# scratch, then τ of each on docs/benchmarks/eval_prompts.jsonl, greedy and T = 1. The paper's claim to check
# (docs/method.md): the sequential head makes the accepted length ~1.15× the parallel-only drafter's.
#   1. self-distillation data from the engine (GEN_PROCS processes for GEN_S seconds, deterministic from DATA_SEED)
#      and the held-out set, as in drafter_long_h200.sh;
#   2. every arm of ARMS, one after another on the same data with the same seed: LAYERS layers, STEPS optimizer steps
#      of one cosine schedule (no time budget: equal steps are the point; the log's slot predictions per second say
#      what each arm costs to train);
#   3. τ of every arm (eval_acceptance, γ = 7, 256 new tokens; T = 1 pooled over T1_SEEDS seeds),
#      $RES/ablation.json (the arms side by side with the ratio to the first arm) and $RES/ablation-h200.{json,png}
#      (per-slot acceptance of every arm, scripts/report_acceptance.py: docs/benchmarks/ablation-h200.*).
# ARMS is a ';'-separated list of NAME=TRAIN_DRAFTER_ARGS; the first arm is the one the others are compared with.
# Needs the target at $MODEL and ShareGPT at $SHAREGPT (docs/training.md, "Reproduction scripts on a GPU machine").
# A CPU dry run: MODEL=smollm2-135m-instruct SHAREGPT= DEVICE=cpu GEN_PROCS=1 GEN_EXTRA="--limit 8 --max-new-tokens 16"
#   HELD_EXTRA="--limit 8 --max-new-tokens 16" STEPS=2 TOKENS=1024 TRAIN_EXTRA="--eval-examples 4" LAYERS=1
#   EVAL_EXTRA="--limit 2 --max-new-tokens 8" ATTENTION=einsum RES=/tmp/res-ablation DATA=/tmp/ablation-dry
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-/tmp/stage/target.gguf}
SHAREGPT=${SHAREGPT-/tmp/stage/sharegpt.json.gz}   # empty: the packaged ShareGPT file
DEVICE=${DEVICE:-auto}
DATA_SEED=${DATA_SEED:-100}
GEN_S=${GEN_S:-180}
GEN_PROCS=${GEN_PROCS:-4}
TEMPS=${TEMPS:-0,1,1,0.6}
MAX_NEW=${MAX_NEW:-384}
LAYERS=${LAYERS:-5}
TOKENS=${TOKENS:-8192}
STEPS=${STEPS:-1800}
LR=${LR:-6e-4}
ATTENTION=${ATTENTION:-flex}
ARMS=${ARMS:-"dspark=--head markov;parallel=--head none"}
T1_SEEDS=${T1_SEEDS:-2}
EVAL_PROMPTS=${EVAL_PROMPTS:-docs/benchmarks/eval_prompts.jsonl}
RES=${RES:-/tmp/res}
DATA=${DATA:-/tmp/ablation}
read -r -a GEN_EXTRA <<< "${GEN_EXTRA:-}"
read -r -a HELD_EXTRA <<< "${HELD_EXTRA:-}"
read -r -a TRAIN_EXTRA <<< "${TRAIN_EXTRA:-}"
read -r -a EVAL_EXTRA <<< "${EVAL_EXTRA:-}"
SOURCE=(); [ -n "$SHAREGPT" ] && SOURCE=(--sharegpt-file "$SHAREGPT")
source "$(dirname "$0")/timeline.sh"  # stamp, run
source "$(dirname "$0")/data.sh"  # self_distill_data

# 1. data (scripts/reproduce/data.sh, as drafter_long_h200.sh makes it; another seed)
self_distill_data || exit 1
cp "$DATA/train/manifest.json" "$RES/ablation-data-manifest.json"

# 2. the arms, one after another: same data, seed, size and steps
IFS=';' read -r -a specs <<< "$ARMS"
names=()
for spec in "${specs[@]}"; do
  name=${spec%%=*}; read -r -a own <<< "${spec#*=}"
  names+=("$name")
  run "train-$name" python -m scripts.train_drafter --data "$DATA/train" --eval-data "$DATA/heldout" \
    --eval-examples 256 --model "$MODEL" --device "$DEVICE" --out "$DATA/$name" --num-layers "$LAYERS" \
    --tokens-per-batch "$TOKENS" --steps "$STEPS" --lr "$LR" --eval-every 500 --log-every 100 --save-every 1000000 \
    --attention "$ATTENTION" --seed 0 --no-resume "${own[@]}" "${TRAIN_EXTRA[@]}" || exit 1
  cp "$DATA/$name/summary.json" "$RES/ablation-train-$name.json" 2>/dev/null
done

# 3. τ of every arm, greedy and T = 1
for name in "${names[@]}"; do
  for t in 0 1; do
    SEEDS=1; [ $t = 1 ] && SEEDS=$T1_SEEDS
    run "tau-$name-T$t" python -m scripts.eval_acceptance --drafter "$DATA/$name" --prompts-file "$EVAL_PROMPTS" \
      --model "$MODEL" --device "$DEVICE" --temperature $t --max-new-tokens 256 --batch-size 60 --seeds $SEEDS \
      --json "$RES/ablation-tau-$name-T$t.json" "${EVAL_EXTRA[@]}"
  done
done
python - "$RES" "${names[@]}" <<'EOF' | tee -a "$RES/timeline.txt"
import json, sys
res, names = sys.argv[1], sys.argv[2:]
arms = {}
for name in names:
    arm = {}
    for t in (0, 1):
        try:
            d = json.load(open(f"{res}/ablation-tau-{name}-T{t}.json"))
        except OSError:
            continue
        arm[f"tau_T{t}"] = d["mean_accepted_length"]
        arm[f"tau_T{t}_se"] = d["mean_accepted_length_se"]
    arms[name] = arm
base = arms[names[0]]
for name, arm in arms.items():
    for t in (0, 1):
        if f"tau_T{t}" in arm and f"tau_T{t}" in base:
            arm[f"ratio_T{t}"] = arm[f"tau_T{t}"] / base[f"tau_T{t}"]
json.dump({"arms": arms, "baseline": names[0]}, open(f"{res}/ablation.json", "w"), indent=1)
print(json.dumps(arms))
EOF
# The per-slot report and plot of docs/benchmarks/ablation-h200.{json,png}: every arm at both temperatures.
evals=()
for name in "${names[@]}"; do
  for t in 0 1; do
    [ -f "$RES/ablation-tau-$name-T$t.json" ] && evals+=(--eval "$name:$t=$RES/ablation-tau-$name-T$t.json")
  done
done
[ ${#evals[@]} -gt 0 ] && run report python -m scripts.report_acceptance "${evals[@]}" --out "$RES/ablation-h200" \
  --note "bash scripts/reproduce/drafter_ablation_h200.sh: ARMS=$ARMS, LAYERS=$LAYERS, STEPS=$STEPS, TOKENS=$TOKENS, LR=$LR, DATA_SEED=$DATA_SEED"
stamp DONE
touch "$RES/DONE"
