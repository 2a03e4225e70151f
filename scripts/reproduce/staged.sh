# Sourced first (after `set -uo pipefail`) by the reproduction scripts that run the staged target model on a GPU
# machine (docs/training.md, "Reproduction scripts on a GPU machine"). It sets:
#   the environment   unbuffered output, no tokenizer threads, the staged wheels (gguf) and the repository on PYTHONPATH
#   MODEL SHAREGPT    the staged target and ShareGPT file (/tmp/stage/...), unless already set
#   DRAFTER RES       the shipped drafter and the results folder (/tmp/res), unless already set
#   SRC               the engine scripts' source arguments: --model, --drafter, --sharegpt-file
#   GPU               h200, h100 or gpu (any other card, or none), for the names of result files
# then sources timeline.sh (stamp, run).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=/tmp/stage/site:$PWD
MODEL=${MODEL:-/tmp/stage/target.gguf}
SHAREGPT=${SHAREGPT:-/tmp/stage/sharegpt.json.gz}
DRAFTER=${DRAFTER:-checkpoints/smollm2-135m-instruct-dspark}
RES=${RES:-/tmp/res}
SRC=(--model "$MODEL" --drafter "$DRAFTER" --sharegpt-file "$SHAREGPT")
GPU=$(python -c "import torch; n = torch.cuda.get_device_name().lower(); print('h200' if 'h200' in n else 'h100' if 'h100' in n else 'gpu')" 2>/dev/null || echo gpu)
source "$(dirname "${BASH_SOURCE[0]}")/timeline.sh"  # stamp, run
