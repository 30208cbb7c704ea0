#!/usr/bin/env bash
# GPU check for one H200 (or any single CUDA GPU), through llm_train's own training path, in a
# world of one, at most ~9 minutes, most important first:
#   (a) SIGTERM -> exit 75 -> --resume auto -> export, for ZeRO-2, ZeRO-3, ZeRO-3 + CPU offload
#       (~100M Llama, bf16);
#   (b) MFU of a Llama-3.2-1B shape, ZeRO-2, bf16, seq 4096 (target 45% of 989 TFLOP/s);
#   (c) the ZeRO-3 / ZeRO-0 step-time ratio on that shape;
#   (d) recipe 7b-rtx4090 under a 24 GiB GPU cap: measured peak GPU memory and host memory (tree PSS)
#       against the planner's estimate.
# One JSON line per result in OUT_DIR/gpu_check.jsonl as it goes (a kill leaves what was done),
# then OUT_DIR/gpu_check_summary.json; OUT_DIR/gpu_check.log has each launch's output tail.
# OUT_DIR is --out DIR, else $OUT, else bench/results/ (dated names). Exit 1 if any line failed.
# bench/gpu_check.py's docstring says how the 9 minutes are budgeted.
#
# On the device machine (the lead's one line; the wheels travel in .whl/, from `make gpu-wheels`):
#   WHEELS=.whl OUT=$OUT bash bench/gpu_check.sh
# i.e. run(command="WHEELS=.whl OUT=$OUT bash bench/gpu_check.sh", carry=[".whl"], timeout_s=600)
#
#   bash bench/gpu_check.sh --cpu-tiny --out /tmp/x   # the same logic on CPU, tiny model (~2-3 min)
#   bash bench/gpu_check.sh --wheels DIR ...          # same as WHEELS=DIR
#
# Wheels: installed beside the machine's packages, llm_train from this checkout (bench/gpu_env.sh).
# Other arguments go to bench/gpu_check.py (--only NAME..., --budget-s S, --expect NAME.QUANTITY=VALUE).
set -euo pipefail
cd "$(dirname "$0")/.."

source bench/gpu_env.sh "$@"

exec "$PY" bench/gpu_check.py ${ARGS[@]+"${ARGS[@]}"}
