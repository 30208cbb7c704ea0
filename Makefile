# Set-up and the two commands the README promises. Everything installs into .venv.
#
# TORCH pins the CPU build this repo's own set-up and CI use (it lies on the CI machine's
# disk). On a GPU machine keep the CUDA torch you have: `make install TORCH=` installs
# nothing torch-related beyond what pyproject.toml's range (torch>=2.4) already accepts.
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The exact versions the suite last passed on (pip-compile's output, torch left out): every install is
# constrained to it, so a fresh machine runs the set CI ran. `make lock` refreshes it (a commit of its own).
LOCK := requirements-lock.txt
EXTRAS := dev,tensorboard,lora,qlora,report,eval
# Tests and the demo never wait on a network that is not there.
OFFLINE := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
# pytest-xdist workers: two keep a 2-core CI machine busy while one test waits (a launch's
# imports, a kill, a single-process run); tests/conftest.py keeps what e2e tests share on one.
TEST_WORKERS ?= 2

.PHONY: install demo test test-fast test-latest lint lock gpu-wheels test-image

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH) -c $(LOCK) -e ".[$(EXTRAS)]"
	$(PY) tools/build_ops.py  # DeepSpeed's CPU ops, built once here instead of inside the suite's first runs
	touch $(STAMP)

install: $(STAMP)

# The embedded default: tiny-cpu, 2 processes of real DeepSpeed ZeRO-3 on CPU.
demo: install
	$(OFFLINE) $(VENV)/bin/accelerate launch --num_processes 2 llm_train/train.py --recipe tiny-cpu --output-dir runs/demo --overwrite

# Every test's duration lands in runs/test-durations.tsv (slowest first); the 20 slowest are printed. A test
# whose optional part (libaio, bitsandbytes, a GPU) is missing is skipped, and the last lines say which.
test: install
	$(OFFLINE) $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=20 \
		--durations-file runs/test-durations.tsv tests

# The canary: the newest releases the index serves, inside the windows and one step past them, in a separate
# environment (.venv-latest); prints which library moved and which tests failed (tools/canary.py).
test-latest: install
	$(PY) tools/canary.py

# Refresh the lock to the newest releases inside pyproject.toml's windows, resolved for this TORCH. Commit
# it alone, after `make test` passes on it (docs/development.md).
lock: install
	echo "$(TORCH)" > $(VENV)/torch-pin.in
	CUSTOM_COMPILE_COMMAND="make lock" $(VENV)/bin/pip-compile --quiet --upgrade --strip-extras \
		--no-emit-index-url --no-emit-find-links --unsafe-package torch --unsafe-package llm-train \
		--unsafe-package pip --extra $(EXTRAS) -o $(LOCK) pyproject.toml $(VENV)/torch-pin.in

test-fast: install
	$(OFFLINE) $(VENV)/bin/pytest -q -m "not e2e" tests

lint: install
	$(VENV)/bin/ruff check llm_train tests bench tools
	$(VENV)/bin/ruff format --check llm_train tests bench tools
	$(VENV)/bin/mypy llm_train

# Wheels for the GPU machine, which reaches no registry: what its image lacks, into .whl/, checked
# complete for its Python 3.12 before they travel (tools/gpu_wheels/build.sh says how they are used there).
gpu-wheels: install
	bash tools/gpu_wheels/build.sh

# The GPU visit's run (bench/gpu_run.sh A --cpu-tiny) in .venv-image, pinned to the GPU image (Python 3.12,
# torch 2.11, its transformers and hub) with the wheels over it as the visit installs them: a break that only
# that mix causes shows here, not in the visit's 15 minutes. Slow the first time (torch 2.11 is downloaded).
test-image: install
	$(OFFLINE) bash tools/gpu_wheels/image_env.sh
