#!/usr/bin/env bash
# Pack a results folder (default /tmp/res) into $OUT as ≤ 15 MB parts: the GPU machine's transfer brings back at
# most 8 files of 16 MiB. Safe to run while a reproduction script is still writing. Unpack with
#   cat bundle.tgz.part-* | tar xz
set -uo pipefail
OUT=${OUT:?OUT must be set}
RES=${RES:-/tmp/res}
nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader > "$RES/gpu-now.txt" 2>/dev/null
tar czf /tmp/bundle.tgz -C "$(dirname "$RES")" "$(basename "$RES")"
split -b 15000000 /tmp/bundle.tgz "$OUT/bundle.tgz.part-"
ls -la "$OUT"
tail -n 25 "$RES/timeline.txt" 2>/dev/null
