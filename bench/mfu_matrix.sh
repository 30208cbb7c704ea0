#!/usr/bin/env bash
# The speed matrix for one H200 (or any single CUDA GPU), at most 8 minutes, most important first:
# llm_train's speed switches one by one on a Llama-3.2-1B-shaped job (bf16, seq 4096, ZeRO-2, micro 4),
# and the Hugging Face Trainer on the same job. One JSON line per variant in OUT_DIR/mfu_matrix.jsonl as
# it goes, then OUT_DIR/mfu_matrix_summary.json; OUT_DIR/mfu_matrix.log has each launch's output tail.
# OUT_DIR is --out DIR, else $OUT, else bench/results/ (dated names). Exit 1 if any line failed (a
# missed target included). bench/mfu_matrix.py's docstring lists the variants, checks and predictions.
#
# On the device machine (the wheels travel in .whl/, from `make gpu-wheels`):
#   WHEELS=.whl OUT=$OUT bash bench/mfu_matrix.sh
# i.e. run(command="WHEELS=.whl OUT=$OUT bash bench/mfu_matrix.sh", carry=[".whl"], timeout_s=600)
#
#   bash bench/mfu_matrix.sh --cpu-tiny --out /tmp/x   # the same logic on CPU, tiny model
# Wheels: installed beside the machine's packages, llm_train from this checkout (bench/gpu_env.sh).
# Other arguments go to bench/mfu_matrix.py (--only NAME..., --budget-s S).
set -euo pipefail
cd "$(dirname "$0")/.."

CHECK=mfu_matrix NEEDED="torch deepspeed accelerate transformers pydantic hjson yaml psutil pyarrow datasets"
source bench/gpu_env.sh "$@"

exec "$PY" bench/mfu_matrix.py ${ARGS[@]+"${ARGS[@]}"}
