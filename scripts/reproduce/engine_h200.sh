#!/usr/bin/env bash
# The engine results on one H200 (≈ 15 min): where a step's time goes (docs/benchmarks/profile-h200-*.json, with and
# without the fused layer ops; Chrome traces of adaptive and fixed K = 7 at batch 1), the kernels alone on the GPU
# (kernels-h200.json), the engine benchmark with the shipped drafter (engine-h200.json; in a server's steady
# state too, with varied request lengths, engine-h200-steady-varied.json), the GPU equivalence run of
# the remaining modes, and the sampling-side kernels' equivalence tests compiled for the GPU. Run on a copy of the repo with the
# target and ShareGPT staged under /tmp/stage, in the background, and collect with scripts/reproduce/pack_results.sh:
#
#   cp -a . /tmp/work && cd /tmp/work && setsid nohup bash scripts/reproduce/engine_h200.sh > /tmp/run.log 2>&1 &
#
# PARTS picks what runs: "timed" (profiles, kernels, engine benchmark: they need the GPU to themselves), "checks"
# (GPU equivalence and the gpu-marked tests: timing-free, they may share the GPU), or both (the default). Every step
# writes its JSON/log into /tmp/res as it finishes; a step cut by its timeout keeps what it wrote.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=/tmp/stage/site:$PWD
MODEL=${MODEL:-/tmp/stage/target.gguf}
SHAREGPT=${SHAREGPT:-/tmp/stage/sharegpt.json.gz}
DRAFTER=${DRAFTER:-checkpoints/smollm2-135m-instruct-dspark}
BENCH_S=${BENCH_S:-300}
STEADY_S=${STEADY_S:-180}
RES=/tmp/res
read -r -a PROFILE_EXTRA <<< "${PROFILE_EXTRA:-}"  # appended to every profile_engine call (dry runs)
read -r -a BENCH_EXTRA <<< "${BENCH_EXTRA:-}"
read -r -a GE_EXTRA <<< "${GE_EXTRA:-}"
read -r -a KB_EXTRA <<< "${KB_EXTRA:-}"
PARTS=${PARTS:-timed checks}
mkdir -p $RES/logs
T0=$(date +%s)
stamp() { echo "$(date +%T) +$(($(date +%s) - T0))s $*" | tee -a $RES/timeline.txt; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > $RES/gpu.txt 2>/dev/null
python -c "from reference.target import Target; Target.load('$MODEL')" > $RES/logs/cache.log 2>&1
stamp "model cache ready"

if [[ " $PARTS " == *" timed "* ]]; then
# 1. Where the time goes: batch 1 and 64, no speculation and fixed K = 3, with the fused layer ops (the default on
#    CUDA) and, at batch 1, with the unfused torch ops (what the fusion buys) (≈ 2 min).
#    Adaptive against fixed K = 7 at batch 1 and 16 (adaptive's step is slower although it verifies no more: at batch
#    16 2.73 against 2.55 ms with 5.6 against 7 tokens per request) also with a Chrome trace each, to see where the
#    difference goes.
for cfg in "none 1 default" "none 1 torch" "fixed:3 1 default" "fixed:3 1 torch" "none 64 default" \
           "fixed:3 64 default" "fixed:7 1 default" "adaptive 1 default" "adaptive 1 ahead" "none 1 async" \
           "fixed:7 16 default" "adaptive 16 default"; do
  set -- $cfg
  name="${1/:/}-b$2$([ "$3" = torch ] && echo -unfused)$([ "$3" = ahead ] && echo -ahead)$([ "$3" = async ] && echo -async)"
  layer=(); [ "$3" = torch ] && layer=(--layer-backend torch); [ "$3" = ahead ] && layer=(--draft-ahead)
  [ "$3" = async ] && layer=(--async-decode)
  trace=(); [[ "$1" == fixed:7 || "$1" == adaptive ]] && trace=(--trace "$RES/trace-$name.json")
  timeout 120 python -m scripts.profile_engine --model "$MODEL" --drafter "$DRAFTER" --sharegpt-file "$SHAREGPT" \
    --mode "$1" --batch-size "$2" "${layer[@]}" "${trace[@]}" --out "$RES/profile-$name.json" "${PROFILE_EXTRA[@]}" \
    > "$RES/logs/profile-$name.log" 2>&1
  stamp "profile $name (rc $?): $(grep -m1 '^step' "$RES/logs/profile-$name.log")"
done

# 2. The kernels alone on the GPU.
timeout ${KB_S:-180} python -m scripts.bench_kernels --op all --out $RES/kernels-h200.json "${KB_EXTRA[@]}" \
  > $RES/logs/bench_kernels.log 2>&1
stamp "bench_kernels (rc $?)"

# 3. The engine benchmark with the shipped drafter, HF generate at every batch size included (the engine runs at least
#    16 requests at every batch size: batch 1 and 4 are then more than one or four prompts).
timeout $((BENCH_S + 90)) python -m scripts.bench_engine --model "$MODEL" --sharegpt-file "$SHAREGPT" \
  --drafter "$DRAFTER" --min-requests 16 --time-budget-s "$BENCH_S" --out $RES/engine-h200.json "${BENCH_EXTRA[@]}" \
  > $RES/logs/bench_engine.log 2>&1
stamp "bench_engine (rc $?)"
# 3b. The same modes in the steady state of a server at max_num_seqs = B (4·B requests, a freed slot refilled at
#     once): a closed batch ends in a tail of its slowest requests, which speculation makes uneven. Request lengths
#     vary (--output-len-spread 0.5, the same in every mode): with equal lengths plain decoding would refill its
#     slots in lockstep while speculative requests admit a prompt nearly every step.
timeout $((STEADY_S + 90)) python -m scripts.bench_engine --model "$MODEL" --sharegpt-file "$SHAREGPT" \
  --drafter "$DRAFTER" --modes none,none+async,fixed:3,fixed:7,adaptive,adaptive+ahead --batch-sizes 1,16,64,256 --requests-per-slot 4 \
  --output-len-spread 0.5 --hf-max-batch 0 --repeats 2 --time-budget-s "$STEADY_S" --out $RES/engine-h200-steady-varied.json "${BENCH_EXTRA[@]}" \
  > $RES/logs/bench_engine_steady.log 2>&1
stamp "bench_engine steady state (rc $?)"
fi

[[ " $PARTS " == *" checks "* ]] || exit 0
# 4. The modes a time-limited GPU equivalence run of all modes may not reach, then the gpu-marked tests to the end.
timeout 300 python -m scripts.gpu_equivalence --model "$MODEL" --drafter "$DRAFTER" --device cuda --limit 6 \
  --max-new-tokens 48 --modes dsd,threshold,adaptive-sync,oracle --time-budget-s 240 \
  --json $RES/gpu-equivalence-rest.json "${GE_EXTRA[@]}" > $RES/logs/gpu_equivalence.log 2>&1
stamp "gpu_equivalence (rc $?)"
timeout 300 python -m pytest -q -m gpu tests/ -p no:cacheprovider > $RES/logs/pytest-gpu.log 2>&1
stamp "pytest -m gpu: $(tail -n 1 $RES/logs/pytest-gpu.log)"
# The sampling-side kernels' equivalence tests compiled for this GPU (on CUDA they run there, not interpreted).
timeout 300 python -m pytest -q tests/equivalence/test_allocate.py tests/equivalence/test_verify.py \
  tests/equivalence/test_sampling.py -p no:cacheprovider > $RES/logs/pytest-kernels.log 2>&1
stamp "kernel equivalence on the GPU: $(tail -n 1 $RES/logs/pytest-kernels.log)"
stamp "DONE"
touch $RES/DONE
