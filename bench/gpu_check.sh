#!/usr/bin/env bash
# GPU check for one H200 (or any single CUDA GPU): MFU and tokens/s of a ~1B Llama (random
# init, ZeRO-2, bf16, seq 4096), the ZeRO-3 / ZeRO-0 step-time ratio and the activation
# checkpointing on/off ratio, through llm_train's own training path. One JSON line per
# measurement; results with date and versions in bench/results/ (and $OUT when set).
#
#   bash bench/gpu_check.sh                 # on the GPU machine (~5-7 minutes)
#   bash bench/gpu_check.sh --cpu-tiny      # the same script end to end on CPU, tiny model
#   WHEELS=/path/to/wheels bash bench/gpu_check.sh
#       installs what the machine lacks (deepspeed, pydantic, hjson, datasets, ...) from a
#       folder of wheels first, without any index (machines that reach no registry).
#
# Other arguments go to bench/gpu_check.py (--only zero2 zero3, --steps N, --micro-batch N).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi

if [[ -n "${WHEELS:-}" ]]; then
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$WHEELS"/*.whl
fi
# llm_train itself from this checkout, without touching the machine's torch/CUDA.
"$PY" -c "import llm_train" 2>/dev/null || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Nothing may wait on a network that is not there.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
export TOKENIZERS_PARALLELISM=false

"$PY" - <<'EOF'
import importlib, sys
missing = [m for m in ("torch", "deepspeed", "accelerate", "transformers", "pydantic", "yaml") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing {', '.join(missing)}; install them or pass WHEELS=folder-of-wheels")
EOF

exec "$PY" bench/gpu_check.py "$@"
