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

CHECK=full_ft_check
source bench/gpu_env.sh "$@"

exec "$PY" bench/full_ft_check.py ${ARGS[@]+"${ARGS[@]}"}
