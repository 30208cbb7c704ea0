#!/usr/bin/env bash
# The consumer-card check for one H200 (or any big CUDA GPU): the QLoRA and LoRA recipes for 12, 16 and
# 24 GB cards under those GPU memory caps, through llm_train's own training path, at most ~8 minutes.
# bench/consumer_check.py's docstring says what each case measures and how the minutes are budgeted.
# One JSON line per case in OUT_DIR/consumer_check.jsonl as it goes, then
# OUT_DIR/consumer_check_summary.json; OUT_DIR/consumer_check.log has each launch's output tail.
# OUT_DIR is --out DIR, else $OUT, else bench/results/ (dated names). Exit 1 if any line failed.
#
# On the device machine (the wheels travel in .whl/, from `make gpu-wheels`; bitsandbytes among them):
#   run(command="WHEELS=.whl OUT=$OUT bash bench/consumer_check.sh", carry=[".whl"], timeout_s=600)
#
#   bash bench/consumer_check.sh --cpu-tiny --out /tmp/x   # the same logic on CPU, tiny model
set -euo pipefail
cd "$(dirname "$0")/.."

CHECK=consumer_check NEEDED="torch deepspeed accelerate transformers peft bitsandbytes pydantic hjson yaml psutil"
source bench/gpu_env.sh "$@"

exec "$PY" bench/consumer_check.py ${ARGS[@]+"${ARGS[@]}"}
