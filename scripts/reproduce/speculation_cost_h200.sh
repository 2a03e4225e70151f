#!/usr/bin/env bash
# What a speculative step costs against a plain one, and whether `adaptive` keeps up with the best mode at every batch
# size (one H200, two parts of under ten minutes each; PART picks one):
#
#   PART=engine    the GPU tests of steps one ahead (tests/equivalence/test_gpu.py: their tokens, and that they never
#                  wait for the stream), then the engine
#                  benchmark in closed batches (docs/benchmarks/engine-h200.json) and with continuous arrivals
#                  (engine-h200-steady.json): plain decoding, fixed K = 7 and adaptive, each synchronous and one
#                  step ahead of its reads ("+async"), and adaptive with the finish-time gate of an offline batch
#                  ("adaptive:finish+async"), every engine with cost feedback (--cost-feedback: the engine a
#                  server runs on CUDA); then what adaptive's draft gate and the finish-time gate estimated at batch
#                  16, 64 and 256, and the accepted drafts the survivals forecast against those accepted, for
#                  adaptive and fixed K = 7 (gate-trace-h200.json, --gate-trace); and adaptive with the survivals
#                  scaled by their measured outcomes (engine-h200-acceptance-feedback.json, --acceptance-feedback)
#   PART=profiles  where a step's time goes, one step ahead (profile-h200-*.json), at batch 1, 16, 64 and 256, then
#                  the remaining GPU tests (every gpu-marked test; the kernels' equivalence tests compiled for the GPU)
#
# Needs the target at $MODEL and ShareGPT at $SHAREGPT (docs/training.md, "Reproduction scripts on a GPU machine").
# Run it on a copy of the repository; `bash scripts/reproduce/pack.sh` packs $RES for the trip back.
set -uo pipefail
source "$(dirname "$0")/staged.sh"  # environment, MODEL, SHAREGPT, DRAFTER, RES, SRC, GPU; stamp, run
PART=${PART:-engine}
MODES=none,none+async,fixed:7,fixed:7+async,adaptive,adaptive+async,adaptive:finish+async

run cache python -c "from reference.target import Target; Target.load('$MODEL')"
if [ "$PART" = engine ]; then
  run tests-ahead timeout 150 python -m pytest -q -p no:cacheprovider tests/equivalence/test_gpu.py \
    -k "one_step_ahead or one_ahead"
  run bench timeout 250 python -m scripts.bench_engine "${SRC[@]}" --modes "$MODES" --batch-sizes 1,4,16,64,256 \
    --min-requests 16 --hf-max-batch 0 --repeats 2 --time-budget-s 210 --cost-feedback --out "$RES/engine-h200.json"
  run steady timeout 230 python -m scripts.bench_engine "${SRC[@]}" \
    --modes none+async,fixed:7+async,adaptive+async,adaptive:finish+async \
    --batch-sizes 1,4,16,64,256 --requests-per-slot 8 --output-len-spread 0.5 --hf-max-batch 0 --repeats 2 \
    --time-budget-s 190 --cost-feedback --out "$RES/engine-h200-steady.json"
  # What the draft gate estimated (best Θ over Θ_plain by batch size): a diagnostic run, not for timing
  run gate-trace timeout 120 python -m scripts.bench_engine "${SRC[@]}" \
    --modes fixed:7+async,adaptive+async,adaptive:finish+async \
    --batch-sizes 16,64,256 --gate-trace --cost-feedback --hf-max-batch 0 --repeats 1 --warmup 0 \
    --out "$RES/gate-trace-h200.json"
  # The same closed batches with the survivals scaled by their measured outcomes (--acceptance-feedback), against the
  # bench run above: whether the gate stops drafting where plain decoding wins
  run acceptance-feedback timeout 150 python -m scripts.bench_engine "${SRC[@]}" --modes none+async,adaptive+async \
    --batch-sizes 16,64,256 --min-requests 16 --hf-max-batch 0 --repeats 2 --cost-feedback --acceptance-feedback \
    --gate-trace --out "$RES/engine-h200-acceptance-feedback.json"
else
  for cfg in "fixed:7 1" "none 1" "fixed:7 16" "fixed:7 64" "fixed:7 256" "adaptive 64" "adaptive 256"; do
    set -- $cfg
    run "profile-${1/:/}-b$2" timeout 90 python -m scripts.profile_engine "${SRC[@]}" --mode "$1" --batch-size "$2" \
      --async-decode --out "$RES/profile-h200-${1/:/}-b$2.json"
  done
  # tests/serving needs the server's packages, which the GPU image does not carry
  run tests-gpu timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/equivalence tests/optimized
  run tests-kernels timeout 150 python -m pytest -q -p no:cacheprovider tests/equivalence/test_verify.py \
    tests/equivalence/test_draft_head.py tests/equivalence/test_layout.py tests/equivalence/test_allocate.py
fi
stamp DONE
touch "$RES/DONE"
