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
# Wheels: every DIR/*.whl except llm_train's own is installed with `pip install --no-index
# --no-deps --target $WHEELS_TARGET` (default /tmp/llm_train_gpu_site) and put on PYTHONPATH,
# so the machine's torch/CUDA stay untouched and nothing reaches for an index; llm_train itself
# runs from this checkout. Other arguments go to bench/gpu_check.py (--only NAME..., --budget-s S,
# --expect NAME.QUANTITY=VALUE).
set -euo pipefail
cd "$(dirname "$0")/.."

ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) WHEELS=${2:?--wheels needs a folder of .whl files}; shift 2 ;;
    --wheels=*) WHEELS=${1#--wheels=}; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi

if [[ -n "${WHEELS:-}" ]]; then
  shopt -s nullglob
  wheels=()
  for w in "$WHEELS"/*.whl; do
    case "$(basename "$w")" in llm_train-*) ;; *) wheels+=("$w") ;; esac
  done
  if [[ ${#wheels[@]} -eq 0 ]]; then
    echo "gpu_check: WHEELS=$WHEELS holds no .whl files; build them with 'make gpu-wheels'" >&2
    exit 2
  fi
  SITE=${WHEELS_TARGET:-/tmp/llm_train_gpu_site}
  echo "gpu_check: installing ${#wheels[@]} wheels from $WHEELS into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# llm_train from this checkout, ahead of any installed copy.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Nothing may wait on a network that is not there.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

"$PY" - <<'EOF'
import importlib.util, sys
needed = ("torch", "deepspeed", "accelerate", "transformers", "pydantic", "hjson", "yaml", "psutil")
missing = [m for m in needed if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing {', '.join(missing)}; install them or pass WHEELS=folder-of-wheels")
EOF

exec "$PY" bench/gpu_check.py "${ARGS[@]}"
