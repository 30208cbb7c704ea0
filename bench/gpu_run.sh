#!/usr/bin/env bash
# The one command to run when a GPU is lent (an 80 GB H100 by default, an H200, or any single CUDA GPU): part A on the first visit, B on
# the next, each ending inside 9.5 minutes (bench/gpu_run.py says what each part holds and why).
#
#   make gpu-wheels                                    # here: .whl/, what that machine lacks
#   run(command="WHEELS=.whl bash bench/gpu_run.sh A", carry=[".whl"], timeout_s=600)
#   run(command="WHEELS=.whl bash bench/gpu_run.sh B --after bench/results/gpu_run_A-h200-DATE.jsonl", ...)
#
#   bash bench/gpu_run.sh A --cpu-tiny --out /tmp/x    # the same logic on CPU, tiny models (CI runs it)
#
# Three files in OUT_DIR (--out DIR, else $OUT, else dated in bench/results/): gpu_run_PART.jsonl (a line
# per case, written as each ends), gpu_run_PART.log (each launch's command and output tail) and
# gpu_run_PART_summary.json. Exit 1 if any line failed. Other arguments go to bench/gpu_run.py
# (--only NAME..., --budget-s S, --expect NAME.QUANTITY=VALUE, --after FILE).
#
# Wheels (WHEELS=DIR or --wheels DIR): every DIR/*.whl but llm_train's own is installed with
# `pip install --no-index --no-deps --target` beside the machine's packages (its torch and CUDA stay
# untouched) and put on PYTHONPATH; llm_train runs from this checkout.
set -euo pipefail
export GPU_RUN_STARTED=${GPU_RUN_STARTED:-$(date +%s)}  # the part's 9.5 minutes count from here
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
    echo "gpu_run: WHEELS=$WHEELS holds no .whl files; build them with 'make gpu-wheels'" >&2
    exit 2
  fi
  SITE=${WHEELS_TARGET:-/tmp/llm_train_gpu_site}
  if [[ ! -f "$SITE/.installed-from-$(basename "$WHEELS")" ]]; then  # a second part in one call reuses it
    echo "gpu_run: installing ${#wheels[@]} wheels from $WHEELS into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
    touch "$SITE/.installed-from-$(basename "$WHEELS")"
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# llm_train and bench from this checkout, ahead of any installed copy; nothing waits on a network.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
# transformers 5.25 with the kernels package (shipped since its closure needs it) fetches hub kernels for CUDA
# layers (kernels-community/rotary) and, offline, raises instead of falling back: every consumer case of the
# H100 run of 2026-12-06 died before step 1 (bench/results/gpu_run_A-h100-20261206-0955.log). llm_train's
# workers and commands now turn it off themselves (runtime/base/compat.py hub_kernels_off); set here too so
# that the HF Trainer side of the comparison loads its model the same way.
export USE_HUB_KERNELS=NO
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

exec "$PY" -m bench.gpu_run ${ARGS[@]+"${ARGS[@]}"}
