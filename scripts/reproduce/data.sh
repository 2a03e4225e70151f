# Sourced by the drafter scripts after timeline.sh, with MODEL, SOURCE, DEVICE, TEMPS, MAX_NEW, DATA_SEED, GEN_S,
# GEN_PROCS, GEN_EXTRA, HELD_EXTRA, DATA and RES set:
#   self_distill_data [MAKE_DATASET_ARGS...]
# generates the self-distillation data with the engine into $DATA/train (GEN_PROCS processes sharing the GPU for
# GEN_S seconds, each taking every GEN_PROCS-th prompt shard: make_dataset's RANK/WORLD_SIZE split; deterministic
# from DATA_SEED; the arguments go to every process, e.g. --start-shard N) and the held-out set into $DATA/heldout.
self_distill_data() {
  stamp "start data-train ($GEN_PROCS processes, ${GEN_S}s)"
  local r
  for ((r = 0; r < GEN_PROCS; r++)); do
    RANK=$r WORLD_SIZE=$GEN_PROCS python -m scripts.make_dataset --out "$DATA/train" --model "$MODEL" "${SOURCE[@]}" \
      --device "$DEVICE" --temperatures "$TEMPS" --max-new-tokens "$MAX_NEW" --batch-size 512 --shard-size 512 \
      --seed "$DATA_SEED" --time-budget-s "$GEN_S" "$@" "${GEN_EXTRA[@]}" > "$RES/logs/data-train-$r.log" 2>&1 &
  done
  wait
  stamp "end data-train"
  run data-heldout python -m scripts.make_dataset --out "$DATA/heldout" --split heldout --model "$MODEL" \
    "${SOURCE[@]}" --device "$DEVICE" --temperatures 0,1 --max-new-tokens "$MAX_NEW" --batch-size 512 \
    --shard-size 1024 "${HELD_EXTRA[@]}"
}
