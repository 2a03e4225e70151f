#!/usr/bin/env bash
# τ per task of the three proposers on one H200: the DSpark drafter, the n-gram proposer and the hybrid of the two,
# greedy and T = 1, on docs/benchmarks/eval_tasks.jsonl (Spec-Bench's six tasks and HumanEval; `--limit 210` takes
# 30 prompts of each of the seven tasks in turn; drop it for all 560). One JSON per run in $RES (tau-tasks-*.json),
# collected into $RES/proposers-tasks-h200.json (scripts/report_proposers.py; the docs render that file).
#
# Needs the target at $MODEL (docs/training.md, "Reproduction scripts on a GPU machine"). Run it on a copy of the
# repository; `bash scripts/reproduce/pack.sh` packs $RES for the trip back.
set -uo pipefail
source "$(dirname "$0")/staged.sh"  # environment, MODEL, SHAREGPT, DRAFTER, RES, SRC, GPU; stamp, run
LIMIT=${LIMIT:-210}
EVAL=(--model "$MODEL" --prompts-file docs/benchmarks/eval_tasks.jsonl --max-new-tokens 256 --limit "$LIMIT")

run cache python -c "from reference.target import Target; Target.load('$MODEL')"
for t in 0 1; do
  seeds=(); [ "$t" = 1 ] && seeds=(--seeds 2)
  run "dspark-t$t" timeout 300 python -m scripts.eval_acceptance "${EVAL[@]}" --drafter "$DRAFTER" --temperature "$t" \
    "${seeds[@]}" --json "$RES/tau-tasks-dspark-t$t.json"
  run "hybrid-t$t" timeout 300 python -m scripts.eval_acceptance "${EVAL[@]}" --drafter "$DRAFTER" --proposer hybrid \
    --temperature "$t" "${seeds[@]}" --json "$RES/tau-tasks-hybrid-t$t.json"
  run "ngram-t$t" timeout 300 python -m scripts.eval_acceptance "${EVAL[@]}" --proposer ngram --temperature "$t" \
    "${seeds[@]}" --json "$RES/tau-tasks-ngram-t$t.json"
done
runs=(); for t in 0 1; do for p in dspark ngram hybrid; do runs+=(--run "$p:$t=$RES/tau-tasks-$p-t$t.json"); done; done
run report python -m scripts.report_proposers "${runs[@]}" --script scripts/reproduce/proposers_tasks_h200.sh \
  --note "T = 1 pooled over 2 seeds (0, 1) per prompt; the n-gram proposer with its defaults (n from 3 down to 1, γ 7); the hybrid with its default n-gram prior." \
  --out "$RES/proposers-tasks-h200.json"
stamp DONE
touch "$RES/DONE"
