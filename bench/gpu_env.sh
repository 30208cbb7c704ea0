#!/usr/bin/env bash
# Sourced by bench/gpu_check.sh and bench/mfu_matrix.sh: the GPU machine's Python with the wheels from
# `make gpu-wheels` on PYTHONPATH, llm_train from this checkout, nothing waiting on a network.
#
# Sets PY and ARGS (the caller's arguments without --wheels). Wheels: every DIR/*.whl except
# llm_train's own is installed with `pip install --no-index --no-deps --target $WHEELS_TARGET`
# (default /tmp/llm_train_gpu_site) and put on PYTHONPATH, so the machine's torch/CUDA stay untouched
# and nothing reaches for an index. DIR is --wheels DIR or $WHEELS.
cd "$(dirname "${BASH_SOURCE[0]}")/.."

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
    echo "gpu_env: WHEELS=$WHEELS holds no .whl files; build them with 'make gpu-wheels'" >&2
    exit 2
  fi
  SITE=${WHEELS_TARGET:-/tmp/llm_train_gpu_site}
  echo "gpu_env: installing ${#wheels[@]} wheels from $WHEELS into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# llm_train from this checkout, ahead of any installed copy.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Nothing may wait on a network that is not there.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

"$PY" - <<'PYEOF'
import importlib.util, sys
needed = ("torch", "deepspeed", "accelerate", "transformers", "pydantic", "hjson", "yaml", "psutil")
missing = [m for m in needed if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_env: missing {', '.join(missing)}; install them or pass WHEELS=folder-of-wheels")
PYEOF
