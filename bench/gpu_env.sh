#!/usr/bin/env bash
# Sourced by the prepared GPU checks (bench/gpu_check.sh, bench/consumer_check.sh): the interpreter, the
# travelled wheels installed beside the machine's own packages, llm_train from this checkout, offline.
#
# Wheels: every $WHEELS/*.whl except llm_train's own is installed with `pip install --no-index --no-deps
# --target $WHEELS_TARGET` (default /tmp/llm_train_gpu_site) and put on PYTHONPATH, so the machine's
# torch/CUDA stay untouched and nothing reaches for an index. Sets PY; expects `set -euo pipefail` and
# the repository root as the working directory. CHECK names the calling check in messages.
#   source bench/gpu_env.sh "$@"    # --wheels DIR (or WHEELS=DIR) is taken; the rest is left in ARGS
CHECK=${CHECK:-gpu_check}
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
    echo "$CHECK: WHEELS=$WHEELS holds no .whl files; build them with 'make gpu-wheels'" >&2
    exit 2
  fi
  SITE=${WHEELS_TARGET:-/tmp/llm_train_gpu_site}
  if [[ ! -f "$SITE/.installed-from-$(basename "$WHEELS")" ]]; then  # a second check in the same call reuses it
    echo "$CHECK: installing ${#wheels[@]} wheels from $WHEELS into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
    touch "$SITE/.installed-from-$(basename "$WHEELS")"
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# llm_train from this checkout, ahead of any installed copy.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Nothing may wait on a network that is not there.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

# Modules the check imports, named by the caller in NEEDED (space separated).
"$PY" - ${NEEDED:-torch deepspeed accelerate transformers pydantic hjson yaml psutil} <<PYEOF
import importlib.util, sys
missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"$CHECK: missing {', '.join(missing)}; install them or pass WHEELS=folder-of-wheels")
PYEOF
