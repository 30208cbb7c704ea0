#!/usr/bin/env bash
# `make gpu-wheels`: the wheels the GPU machine lacks, in .whl/, checked complete before they travel.
#
# The GPU machine runs a fixed Python 3.12 image with torch, accelerate,
# transformers and friends (tools/gpu_wheels/machine_packages.txt) and reaches no package registry. It lacks
# deepspeed, hjson, datasets, dill, multiprocess, pydantic(-core), annotated-types, typing-inspection,
# bitsandbytes, wandb and liger-kernel, and llm_train itself. This script writes those wheels (CPython 3.12, manylinux x86_64 or
# pure Python; the releases of requirements-lock.txt, so what is tested here is what travels) into .whl/. There:
#
#   pip install --no-index --no-deps --target DIR .whl/*.whl
#   PYTHONPATH=DIR bash bench/gpu_run.sh A   # (bench/gpu_run.sh does both, given WHEELS=.whl)
#
# `--no-deps` means no resolver runs there, so tools/gpu_wheels/check.py runs one here at the end: every
# wheel's Requires-Dist met by another wheel or by the image, tags for cp312 manylinux, one version
# per project, under the size budget; then pip's own resolver offline over the same set. A failure
# here is cheaper than one in the GPU machine's 15 minutes.
#
#   bash tools/gpu_wheels/build.sh          # or: make gpu-wheels
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root

PY=${PYTHON:-.venv/bin/python}
OUT=.whl
BUDGET_MIB=40
PRESENT=tools/gpu_wheels/machine_packages.txt

# What pip on the GPU machine accepts: CPython 3.12, manylinux up to glibc 2.28, or pure Python.
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_28_x86_64 --platform any --no-deps)

installed() { "$PY" -c 'import importlib.metadata, sys; print(importlib.metadata.version(sys.argv[1]))' "$1"; }
LOCK=requirements-lock.txt
# The release of NAME in the lock (the tested set), else the one this .venv has (liger-kernel is in neither).
locked() { grep -i -m1 "^${1//_/[-_]}==" "$LOCK" | cut -d= -f3 || true; }
pins() { for name in "$@"; do v=$(locked "$name"); echo "$name==${v:-$(installed "$name")}"; done; }
# This machine's pip config names local index folders that lack most projects; pip warns per project.
pip_() { "$PY" -m pip -q --disable-pip-version-check "$@" 2> >(grep -v 'is ignored: it is neither a file' >&2); }
mib() { du -cb "$@" | tail -1 | awk '{printf "%.1f", $1 / 1048576}'; }

rm -rf "$OUT"
mkdir -p "$OUT"
SRC=$(mktemp -d)  # scratch: the source copy, and wheels that travel only if they fit
trap 'rm -rf "$SRC" "${OVER:-}"' EXIT

# DeepSpeed publishes only an sdist. DS_BUILD_OPS=0 compiles nothing (its CUDA ops JIT-build on the GPU
# machine with its own nvcc), so the wheel is pure Python; no build isolation, because its setup.py
# imports torch and an isolated build would fetch a multi-GB one.
DS_BUILD_OPS=0 pip_ wheel --no-deps --no-build-isolation \
  -w "$OUT" "$(pins deepspeed)"
ls "$OUT"/deepspeed-*-py3-none-any.whl >/dev/null || {
  echo "gpu-wheels: deepspeed did not build as py3-none-any: $(ls "$OUT")" >&2
  exit 1
}

# What the image lacks (tools/gpu_wheels/lacking.txt; deepspeed above, bitsandbytes below): msgpack because
# deepspeed requires it and nothing in the image does; typing-extensions although the image has one (see there).
LACKING=$(grep -v -e '^#' -e '^$' tools/gpu_wheels/lacking.txt | grep -v -x -e deepspeed -e bitsandbytes)
pip_ download "${TARGET[@]}" -d "$OUT" $(pins $LACKING)

# bitsandbytes (QLoRA, lora.quantize): its wheel carries a compiled library per CUDA and ROCm version
# (41 MiB). The machine's torch is built for CUDA 13.0, and bitsandbytes loads the library matching
# torch.version.cuda, so only libbitsandbytes_cuda130.so and the CPU one travel (~3.4 MiB).
BNB=$(mktemp -d)
pip_ download "${TARGET[@]}" -d "$BNB" "$(pins bitsandbytes)"
"$PY" tools/gpu_wheels/slim_wheel.py "$BNB"/bitsandbytes-*.whl --drop '\.so$' --keep 'libbitsandbytes_(cpu|cuda130)\.so$' -o "$OUT"
rm -rf "$BNB"

# The image's own copies of the libraries whose internals llm_train touches (runtime/base/compat.py WINDOWS:
# transformers, accelerate, peft on the image), where the image has another release than the lock or one not
# known here: the lock's release travels and shadows the image's on PYTHONPATH, so the GPU run runs the tested
# set (transformers 5.17 there). torch stays the image's, and so do libraries used through public calls only
# (huggingface-hub, tokenizers: the lock's hub 2.x would bring hf-xet and httpx2 along). A wheel that would take
# the folder past the budget is left out and named; every result records which libraries ran at another
# release than the lock's (bench/environment.py not_the_lock).
WINDOWED=$("$PY" -c 'from llm_train.runtime.base.compat import WINDOWS; print(" ".join(w.library for w in WINDOWS))')
OVER_IMAGE=$("$PY" -m tools.gpu_wheels.over_image --present "$PRESENT" --lock "$LOCK" $WINDOWED)
OVER=$(mktemp -d)
for pin in $OVER_IMAGE; do
  pip_ download "${TARGET[@]}" -d "$OVER" "$pin"
done
for wheel in "$OVER"/*.whl; do
  [[ -e "$wheel" ]] || continue
  if awk -v t="$(mib "$OUT"/*.whl "$wheel")" -v b="$BUDGET_MIB" 'BEGIN { exit !(t < b) }'; then
    mv "$wheel" "$OUT"/
  else
    echo "gpu-wheels: $(basename "$wheel") left out (over ${BUDGET_MIB} MiB): the GPU run uses the image's release"
  fi
done

# Liger's kernels (memory.liger_kernels) are Triton and run on GPUs only, so this .venv has no copy to
# pin: the version bench/mfu_matrix.py was written against. Pure Python (~0.9 MiB); it needs torch and
# triton, which the image's CUDA torch brings.
pip_ download "${TARGET[@]}" -d "$OUT" liger-kernel==0.8.5

# llm_train from a clean copy of the working tree (tracked and new files, not ignored ones): a build in
# place reuses build/lib, which keeps modules that have since been deleted or moved.
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [[ -e "$f" ]] && printf '%s\0' "$f"
done | tar --null -T - -cf - | tar -xf - -C "$SRC"
pip_ wheel --no-deps --no-build-isolation -w "$OUT" "$SRC"

# Closure: whatever the wheels so far need that the image does not meet travels at the lock's release, and
# so does an image package whose own requirement a shipped wheel breaks (tools/gpu_wheels/image_requires.txt).
# transformers 5.25 brought huggingface-hub >= 2.4 and kernels; hub 2.x brings httpx2; the image's tokenizers
# 0.23.2 caps the hub below 2.0, so the lock's tokenizers travels too. Each round adds what the last one needed.
IMAGE_REQUIRES=tools/gpu_wheels/image_requires.txt
for round in 1 2 3 4 5 6 7 8; do
  MORE=$("$PY" tools/gpu_wheels/check.py "$OUT" --present "$PRESENT" --image-requires "$IMAGE_REQUIRES" \
    --waive wandb --pins-for-missing "$LOCK")
  [[ -z "$MORE" ]] && break
  echo "gpu-wheels: the lock's releases need over the image (round $round):" $MORE
  pip_ download "${TARGET[@]}" -d "$OUT" $MORE
done

# wandb is optional there (the GPU check runs tracking.mode=disabled, and llm_train imports wandb only
# when a tracker is on): it travels only if it and what it pulls in keep the folder under the budget.
WANDB=(wandb cwevals distro platformdirs googleapis-common-protos opentelemetry-api opentelemetry-sdk
  opentelemetry-semantic-conventions opentelemetry-proto opentelemetry-exporter-otlp-proto-http
  opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common
  opentelemetry-exporter-http-transport)
pip_ download "${TARGET[@]}" -d "$SRC/wandb" $(pins "${WANDB[@]}")
WAIVE=()
core=$(mib "$OUT"/*.whl)
with_wandb=$(mib "$OUT"/*.whl "$SRC"/wandb/*.whl)
if awk -v t="$with_wandb" -v b="$BUDGET_MIB" 'BEGIN { exit !(t < b) }'; then
  mv "$SRC"/wandb/*.whl "$OUT"/
  echo "gpu-wheels: wandb included (${core} MiB without it, ${with_wandb} MiB with it)"
else
  WAIVE=(--waive wandb)
  echo "gpu-wheels: wandb left out: ${with_wandb} MiB with it is over ${BUDGET_MIB} MiB (${core} MiB without)"
fi

"$PY" tools/gpu_wheels/check.py "$OUT" --present "$PRESENT" --image-requires "$IMAGE_REQUIRES" \
  --budget-mib "$BUDGET_MIB" "${WAIVE[@]}" \
  --resolve 'llm_train[qlora]' liger-kernel
