#!/usr/bin/env bash
# Data-parallel training scaling on one H200 host (~7 min on 8 GPUs): docs/benchmarks/training-scaling.{json,png}.
#   1. for each GPU count n in 1, 2, 4, 8 up to the host's (or in $GPUS): scripts/train_drafter.py under torchrun on
#      n GPUs, fresh, STEPS steps (~1 min of training at ~0.45 s per step) at TOKENS padded tokens per rank (weak
#      scaling: the per-rank batch is fixed, the global batch grows with n), logged every LOG_EVERY steps, with no
#      evaluation or save until the end;
#   2. $RES/training-scaling.json + .png (scripts/report_training_scaling.py): supervised slot predictions per second
#      per GPU count (the median over the logged intervals, the first left out) and the scaling efficiency
#      throughput_n / (n · throughput_1).
# Needs the target at $MODEL and self-distilled data at $DATA (a scripts/make_dataset.py output; the default is where
# scripts/reproduce/drafter_h200.sh writes its training set). Run it on a copy of the repository, in the background;
# `bash scripts/reproduce/pack.sh` packs $RES for the trip back.
# A CPU dry run (gloo): GPUS="1 2" DEVICE=cpu OMP_NUM_THREADS=1 MODEL=DIR DATA=DIR STEPS=6 LOG_EVERY=1 TOKENS=256 TRAIN_EXTRA="--eval-examples 8" ...
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast (NVLS) stays off: the gradient all-reduce does not need it, and on a shared host a program that
# uses it can take the GPUs out of service. NCCL logs its version and the transports it picked into each run's log.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-INFO} NCCL_DEBUG_SUBSYS=${NCCL_DEBUG_SUBSYS:-INIT}
MODEL=${MODEL:-/tmp/stage/target.gguf}
DATA=${DATA:-/tmp/sd/train}
DEVICE=${DEVICE:-auto}
STEPS=${STEPS:-130}
TOKENS=${TOKENS:-16384}
LOG_EVERY=${LOG_EVERY:-5}
RES=${RES:-/tmp/res}
RUNS=${RUNS:-/tmp/runs}
if [ -z "${GPUS:-}" ]; then
  N=$(nvidia-smi -L 2>/dev/null | wc -l)
  [ "$N" -ge 1 ] || { echo "no GPU found by nvidia-smi; set GPUS (e.g. GPUS=\"1 2\" DEVICE=cpu for a dry run)" >&2; exit 1; }
  GPUS=$(for n in 1 2 4 8; do [ "$n" -le "$N" ] && echo "$n"; done)
fi
read -r -a TRAIN_EXTRA <<< "${TRAIN_EXTRA:-}"   # e.g. "--eval-examples 8" for a CPU dry run on tiny data
source "$(dirname "$0")/timeline.sh"  # stamp, run

command -v nvidia-smi > /dev/null && nvidia-smi topo -m > "$RES/training-scaling-topology.txt" 2>&1   # the GPU links
reports=()
for n in $GPUS; do
  rm -rf "${RUNS:?}/scale-$n"   # fresh: metrics.jsonl is appended to, and a resumed run would start mid-schedule
  run "scale-$n" torchrun --standalone --nproc-per-node "$n" -m scripts.train_drafter --data "$DATA" \
    --model "$MODEL" --device "$DEVICE" --out "$RUNS/scale-$n" --steps "$STEPS" --tokens-per-batch "$TOKENS" \
    --log-every "$LOG_EVERY" --eval-every 1000000 --save-every 1000000 --eval-examples 64 --no-resume \
    "${TRAIN_EXTRA[@]}" &&
    mkdir -p "$RES/scale-$n" && cp "$RUNS/scale-$n/summary.json" "$RUNS/scale-$n/metrics.jsonl" "$RES/scale-$n/" &&
    reports+=(--run "$n=$RES/scale-$n")
done
run scaling-report python -m scripts.report_training_scaling "${reports[@]}" --out "$RES/training-scaling" \
  --note "Weak scaling of scripts/train_drafter.py on $(echo $GPUS | tr ' ' ',') GPU(s) of one host: $TOKENS padded \
tokens per rank and step, $STEPS steps per run, NCCL with NVLink multicast off. Command: \
bash scripts/reproduce/training_scaling_h200.sh" && cat "$RES/logs/scaling-report.log"
stamp DONE
touch "$RES/DONE"
