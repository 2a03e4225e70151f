#!/usr/bin/env bash
# Pack what a scripts/reproduce/*.sh run has finished so far (/tmp/res) into $OUT as ≤ 15 MB parts (small enough for
# any file-transfer limit of 16 MiB). Safe to call any number of times while the run goes on. PACK names what to pack
# under /tmp (default "res"; e.g. PACK="--exclude=res/ship res res2"). Unpack here with
#   cat bundle.tgz.part-* | tar xz
set -uo pipefail
OUT=${OUT:?OUT must be set}
cp /tmp/run.log /tmp/res/run.log 2>/dev/null
nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader > /tmp/res/gpu-now.txt 2>/dev/null
tar czf /tmp/bundle.tgz -C /tmp ${PACK:-res}
split -b 15000000 /tmp/bundle.tgz "$OUT/bundle.tgz.part-"
ls -la "$OUT"
tail -n 25 /tmp/res/timeline.txt 2>/dev/null
