#!/usr/bin/env bash
# The full fine-tune check on one GPU (bench/full_ft_check.py says what and why), at most ~4.5 minutes:
#   f_7b_cpu_offload   7b-rtx4090 under a 24 GiB cap: host PSS within the planner's estimate and < 120 GiB,
#                      the mlocked bytes, tokens/s;
#   f_1p5b_cpu_offload Qwen2.5-1.5B, optimizer on CPU (the reference losses);
#   f_1p5b_nvme        the same with the optimizer on the local disk: swap bytes and GB/s, host peak
#                      against the planner, losses against f_1p5b_cpu_offload.
# One JSON line per case in OUT_DIR/full_ft_check.jsonl as it goes, each with its verdict (`passed`,
# `checks`); OUT_DIR/full_ft_check.log has each launch's tail. Exit 1 if any line failed.
#
# On the device machine (the wheels travel in .whl/, from `make gpu-wheels`):
#   run(command="WHEELS=.whl OUT=$OUT bash bench/full_ft_check.sh", carry=[".whl"], timeout_s=360)
#   bash bench/full_ft_check.sh --cpu-tiny --out /tmp/x   # the same logic on CPU, tiny model (CI runs it)
# Other arguments go to bench/full_ft_check.py (--only NAME..., --budget-s S, --nvme-dir DIR).
set -euo pipefail
cd "$(dirname "$0")/.."

ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) WHEELS=${2:?--wheels needs a folder of .whl files}; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
PY=${PYTHON:-}
[[ -n "$PY" ]] || { [[ -x .venv/bin/python ]] && PY=.venv/bin/python || PY=python3; }
if [[ -n "${WHEELS:-}" ]]; then
  # As bench/gpu_check.sh: the wheels beside the image's torch/CUDA, llm_train from this checkout.
  SITE=${WHEELS_TARGET:-/tmp/llm_train_gpu_site}
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  wheels=("${wheels[@]/*\/llm_train-*/}")
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" ${wheels[@]}
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec "$PY" bench/full_ft_check.py "${ARGS[@]}"
