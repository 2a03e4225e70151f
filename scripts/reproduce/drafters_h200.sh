#!/usr/bin/env bash
# The drafters from scratch on 1 or 2 H200s (two is faster): self-distilled data, the four training arms with the same
# data / seed / step count, calibration, τ per arm, the GPU equivalence run, the engine benchmark and the kernel
# benchmark. Started once, in the background, on a copy of the repo:
#
#   cp -a . /tmp/work && cd /tmp/work && setsid nohup bash scripts/reproduce/drafters_h200.sh > /tmp/run.log 2>&1 &
#
# and collected by scripts/reproduce/pack_results.sh (any number of times: each call packs what is finished so far).
# The model and ShareGPT must be staged under /tmp/stage first. Budgets (seconds) are env overrides.
#
# Layout: /tmp/sd (data), /tmp/runs/<arm> (training runs), /tmp/res (small results to bring back),
# /tmp/res/ship/<name> (calibrated checkpoints to ship), /tmp/res/timeline.txt (what ran when, on which GPU).
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-6}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/stage/site:$PWD
MODEL=${MODEL:-/tmp/stage/target.gguf}
SHAREGPT=${SHAREGPT:-/tmp/stage/sharegpt.json.gz}
GEN_S=${GEN_S:-170}            # self-distillation budget per GPU (model load included)
TRAIN_S=${TRAIN_S:-300}        # training time of one arm; the step count is fixed from a probe of the Markov arm
DEADLINE_S=${DEADLINE_S:-1320} # nothing new starts that could not finish before this (from the start of this script)
BENCH_S=${BENCH_S:-300}
GE_S=${GE_S:-150}              # GPU equivalence run
PYTEST_S=${PYTEST_S:-240}      # pytest -m gpu (100 s cut it after 7 tests on 2026-11-29)
HELD_N=${HELD_N:-512}          # held-out sequences (training eval, calibration)
# Extra arguments appended to each step's command (argparse keeps the last value): a CPU dry run of this script
# shrinks every step with them, e.g. GEN_EXTRA="--limit 8 --batch-size 4 --shard-size 4 --max-new-tokens 8".
read -r -a GEN_EXTRA <<< "${GEN_EXTRA:-}"
read -r -a TRAIN_EXTRA <<< "${TRAIN_EXTRA:-}"
read -r -a EVAL_EXTRA <<< "${EVAL_EXTRA:-}"
read -r -a CAL_EXTRA <<< "${CAL_EXTRA:-}"
read -r -a BENCH_EXTRA <<< "${BENCH_EXTRA:-}"
read -r -a GE_EXTRA <<< "${GE_EXTRA:-}"
read -r -a KB_EXTRA <<< "${KB_EXTRA:-}"
RES=/tmp/res
mkdir -p $RES/logs $RES/ship /tmp/sd /tmp/runs
T0=$(date +%s)
NGPU=$(nvidia-smi -L | wc -l)
G1=$((NGPU > 1 ? 1 : 0))       # the second GPU, or the only one
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > $RES/gpu.txt
left() { echo $((DEADLINE_S - ($(date +%s) - T0))); }
stamp() { echo "$(date +%T) +$(($(date +%s) - T0))s $*" | tee -a $RES/timeline.txt; }
on() { local g=$1; shift; CUDA_VISIBLE_DEVICES=$g LOCAL_RANK=0 "$@"; }

stamp "start: $NGPU GPU(s), budgets gen $GEN_S s, train $TRAIN_S s, deadline $DEADLINE_S s"
# 0. Dequantize the GGUF once into the shared cache (every later process loads the cached HF directory).
python -c "from reference.target import Target; Target.load('$MODEL')" > $RES/logs/cache.log 2>&1
stamp "model cache ready"

# 1. Self-distillation (docs/method.md §2) on every GPU: shards are dealt out by RANK; each rank stops starting shards when
#    its budget would run out, the manifest says how many were made.
for ((g = 0; g < NGPU; g++)); do
  on $g env RANK=$g WORLD_SIZE=$NGPU python scripts/make_dataset.py --out /tmp/sd/train --model "$MODEL" \
    --sharegpt-file "$SHAREGPT" --batch-size 1024 --shard-size 1024 --max-new-tokens 256 --time-budget-s "$GEN_S" \
    "${GEN_EXTRA[@]}" > $RES/logs/make_train-$g.log 2>&1 &
done
wait
stamp "train data: $(python -c "import json;m=json.load(open('/tmp/sd/train/manifest.json'));print(m['examples'],'seqs',m['response_tokens'],'response tokens')")"

# 2. Held-out set, then a probe of the Markov arm's step time on an otherwise idle GPU (a probe that shared the GPU
#    with the held-out generation measured 0.62 s/step on 2026-11-29, against 0.25 s/step alone: arms got 2.5x too
#    few steps). The first 20 steps (kernel compilation, allocator warm-up) are left out of the estimate.
on $G1 python scripts/make_dataset.py --out /tmp/sd/heldout --split heldout --model "$MODEL" --sharegpt-file "$SHAREGPT" \
  --limit "$HELD_N" --batch-size 512 --shard-size 256 --max-new-tokens 256 "${GEN_EXTRA[@]}" > $RES/logs/make_heldout.log 2>&1
common=(--data /tmp/sd/train --model "$MODEL" --num-layers 2 --markov-rank 64 --gamma 7 --tokens-per-batch 16384
        --anchors-per-seq 32 --save-dtype bfloat16 --save-every 1000000 --log-every 10 --seed 0)
on 0 python scripts/train_drafter.py "${common[@]}" --eval-examples 16 --eval-every 1000000 --head markov --steps 60 \
  --log-every 5 "${TRAIN_EXTRA[@]}" --out /tmp/probe > $RES/logs/probe.log 2>&1
STEPS=$(TRAIN_S=$TRAIN_S python - <<'EOF2'
import json, os
rows = [json.loads(l) for l in open("/tmp/probe/metrics.jsonl") if '"train"' in l]
rows = [r for r in rows if r["step"] >= 20] or rows
a, b = rows[0], rows[-1]
s_per_step = (b["elapsed_s"] - a["elapsed_s"]) / max(1, b["step"] - a["step"])
print(max(50, int(float(os.environ["TRAIN_S"]) / s_per_step)))
EOF2
)
if ! [[ "$STEPS" =~ ^[0-9]+$ ]]; then
  stamp "probe failed (see logs/probe.log): stopping"; touch $RES/DONE; exit 1
fi
stamp "probe: $(grep -c '"train"' /tmp/probe/metrics.jsonl) log rows; every arm trains $STEPS steps; held-out set done"
echo "$STEPS" > $RES/steps.txt
train() {  # train GPU ARM extra-args...
  local g=$1 arm=$2; shift 2
  stamp "train $arm on GPU $g ($STEPS steps)"
  on $g python scripts/train_drafter.py "${common[@]}" --eval-data /tmp/sd/heldout --eval-examples 128 \
    --eval-every 250 --steps "$STEPS" --time-budget-min "$(python -c "print(round(2.0 * $TRAIN_S / 60, 2))")" \
    --out /tmp/runs/$arm "$@" "${TRAIN_EXTRA[@]}" > $RES/logs/train-$arm.log 2>&1
  cp /tmp/runs/$arm/{summary.json,metrics.jsonl,README.md} $RES/logs/ 2>/dev/null
  mkdir -p $RES/runs/$arm && cp /tmp/runs/$arm/{summary.json,metrics.jsonl,README.md} $RES/runs/$arm/
  stamp "trained $arm: $(tail -n 1 $RES/logs/train-$arm.log | cut -c1-150)"
}
evaluate() {  # evaluate GPU ARM: τ at T = 0 and T = 1 on the held-out chat / code / math-like prompts, side by side
  local g=$1 arm=$2
  for t in 0 1; do
    on $g python scripts/eval_acceptance.py --drafter /tmp/runs/$arm --prompts-file docs/benchmarks/eval_prompts.jsonl \
      --model "$MODEL" --temperature $t --max-new-tokens 128 --batch-size 60 \
      --json $RES/acceptance-$arm-T$t.json "${EVAL_EXTRA[@]}" > $RES/logs/eval-$arm-T$t.log 2>&1 &
  done
  wait
  stamp "evaluated $arm: $(python -c "import json;print([json.load(open('$RES/acceptance-$arm-T'+t+'.json'))['mean_accepted_length'] for t in '01'])" 2>&1 | tail -n 1)"
}
calibrate() {  # calibrate GPU ARM SHIPNAME: STS on held-out proposals, then a copy to ship
  local g=$1 arm=$2 name=$3
  on $g python scripts/calibrate.py --drafter /tmp/runs/$arm --data /tmp/sd/heldout --model "$MODEL" \
    --dump-proposals $RES/proposals-$arm "${CAL_EXTRA[@]}" > $RES/logs/calibrate-$arm.log 2>&1
  rm -rf $RES/ship/$name && mkdir -p $RES/ship/$name
  (cd /tmp/runs/$arm && cp -a $(ls | grep -v '^_state$') $RES/ship/$name/)
  stamp "calibrated $arm -> ship/$name: $(grep -i 'ece' $RES/logs/calibrate-$arm.log | tail -n 2 | tr '\n' ' ' | cut -c1-200)"
}

# 3. Arm 1 first: its calibrated checkpoint is the drafter the engine measurements use.
arm1() {
  train $1 markov --head markov
  calibrate $1 markov smollm2-135m-instruct-dspark
  rm -rf checkpoints/smollm2-135m-instruct-dspark && cp -a $RES/ship/smollm2-135m-instruct-dspark checkpoints/
}
engine_work() {  # engine_work GPU: the engine benchmark (alone on its GPU), the GPU equivalence run, gpu tests
  stamp "bench_engine"
  on $1 timeout $((BENCH_S + 60)) python -m scripts.bench_engine --model "$MODEL" --sharegpt-file "$SHAREGPT" \
    --drafter checkpoints/smollm2-135m-instruct-dspark --time-budget-s "$BENCH_S" --cost-cache-dir /tmp/costcache \
    --out $RES/engine-h200.json "${BENCH_EXTRA[@]}" > $RES/logs/bench_engine.log 2>&1
  stamp "bench_engine done (rc $?)"
  on $1 timeout $((GE_S + 40)) python -m scripts.gpu_equivalence --model "$MODEL" \
    --drafter checkpoints/smollm2-135m-instruct-dspark --device cuda --limit 6 --max-new-tokens 48 \
    --time-budget-s "$GE_S" --json $RES/gpu-equivalence.json "${GE_EXTRA[@]}" > $RES/logs/gpu_equivalence.log 2>&1
  stamp "gpu_equivalence done (rc $?)"
  on $1 timeout "$PYTEST_S" python -m pytest -q -m gpu tests/ -p no:cacheprovider > $RES/logs/pytest-gpu.log 2>&1
  stamp "pytest -m gpu: $(tail -n 1 $RES/logs/pytest-gpu.log)"
}

# Two GPUs. GPU 0: arm 1, its τ, the engine work. GPU 1: parallel CE+L1 (arm 3), CE-only (arm 4), RNN (arm 2) while
# time is left, their τ, the kernel benchmark.
lane0() {
  arm1 0
  evaluate 0 markov
  engine_work 0
}
lane1() {
  local g=$G1
  train $g parallel --head none
  train $g dflash --head none --loss-weights 1,0,0
  calibrate $g parallel smollm2-135m-instruct-parallel
  evaluate $g parallel
  evaluate $g dflash
  if [ "$(left)" -gt $((TRAIN_S + 150)) ]; then
    train $g rnn --head rnn
    evaluate $g rnn
  else
    stamp "skip the RNN arm: $(left) s left before the deadline"
  fi
  stamp "bench_kernels"
  on $g timeout 150 python -m scripts.bench_kernels --out $RES/kernels-h200.json "${KB_EXTRA[@]}" > $RES/logs/bench_kernels.log 2>&1
  stamp "bench_kernels done (rc $?)"
}

# One GPU: the engine work right after arm 1 (so it finishes early), then the other arms while time is left, then
# every evaluation side by side on the GPU.
single() {
  arm1 0
  engine_work 0
  local arms="markov"
  for arm in parallel dflash rnn; do
    if [ "$(left)" -lt $((TRAIN_S + 160)) ]; then stamp "skip $arm: $(left) s left before the deadline"; continue; fi
    case $arm in
      parallel) train 0 parallel --head none ;;
      dflash) train 0 dflash --head none --loss-weights 1,0,0 ;;
      rnn) train 0 rnn --head rnn ;;
    esac
    arms="$arms $arm"
  done
  [ -d /tmp/runs/parallel ] && calibrate 0 parallel smollm2-135m-instruct-parallel &
  for arm in $arms; do evaluate 0 $arm & done
  wait
}

if [ "$NGPU" -gt 1 ]; then
  lane0 & lane1 & wait
else
  single
fi
stamp "DONE"
touch $RES/DONE
