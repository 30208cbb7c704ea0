#!/usr/bin/env bash
# `make test-image`: the GPU visit's own run, on this CPU, in an environment pinned to the GPU image.
#
# The GPU machine runs Python 3.12 with torch 2.11 and its own releases of transformers, the hub, tokenizers
# and friends (tools/gpu_wheels/machine_packages.txt), and `make gpu-wheels`' wheels installed over them with
# `--no-deps --target` on PYTHONPATH. The suite runs on another set (the lock, torch 2.13, Python 3.11), so a
# break that only that mix causes (a wheel that needs a newer torch, an image package a shipped wheel breaks,
# code that uses an API torch 2.11 lacks) would first show in the visit's 15 minutes. This builds the same mix
# here, .venv-image: Python 3.12, every line of machine_packages.txt installed as written (torch 2.11.* from
# the package index: its CUDA build, which runs on CPU; about 4.6 GB, cached by pip after the first time),
# then runs `bench/gpu_run.sh A --cpu-tiny` through the wheels exactly as the visit does (gpu_run.sh
# installs them with --no-deps --target and puts them on PYTHONPATH). Part A holds the probe, the consumer
# cases with GRPO, and the speed matrix's baseline and Trainer peer. Too slow for the 15-minute suite (the
# first build downloads torch); `.ci/run` runs it after `make test`, and it is the check to run before a visit.
#
#   bash tools/gpu_wheels/image_env.sh [OUT_DIR]     # or: make test-image
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root

VENV=.venv-image
PRESENT=tools/gpu_wheels/machine_packages.txt
OUT=${1:-runs/test-image}
STAMP=$VENV/.installed-$(sha1sum "$PRESENT" | cut -c1-12)

# Python 3.12, as the image: IMAGE_PYTHON, pyenv's, or python3.12 on PATH; the first that runs as 3.12 (a
# pyenv shim can exist and still refuse to run).
PY312=
for candidate in ${IMAGE_PYTHON:-} "$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python 2>/dev/null | tail -1)" \
  "$(command -v python3.12 || true)"; do
  if [[ -n "$candidate" ]] && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    PY312=$candidate
    break
  fi
done
if [[ -z "$PY312" ]]; then
  echo "test-image: no Python 3.12 here (the GPU image's); install one or set IMAGE_PYTHON=/path/to/python3.12" >&2
  exit 2
fi

if [[ ! -f "$STAMP" ]]; then
  rm -rf "$VENV"
  "$PY312" -m venv "$VENV"
  # Each line of the packages file is a requirement as the image meets it (a release, a range or a bare name).
  mapfile -t IMAGE < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$PRESENT" | grep -v '^$')
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${IMAGE[@]}" \
    2> >(grep -v 'is ignored: it is neither a file' >&2)
  touch "$STAMP"
fi
"$VENV/bin/python" -c 'import sys, torch, transformers; print(f"test-image: Python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__} (the image)")'

bash tools/gpu_wheels/build.sh  # the wheels of the lock as it is now (about a minute)
mkdir -p "$OUT"
# A fresh --target each time: the wheels may have been rebuilt since the last run.
export WHEELS_TARGET
WHEELS_TARGET=$(mktemp -d)
trap 'rm -rf "$WHEELS_TARGET"' EXIT
PYTHON="$VENV/bin/python" WHEELS=.whl bash bench/gpu_run.sh A --cpu-tiny --out "$OUT"
