"""Shared test helpers: launching llm_train as its launchers do, on CPU, each launch on its own port.

`launch` gives the workers their ranks the way torchrun does (tests/workers.py says why most tests use it);
`accelerate_launch` goes through `accelerate launch`, for the tests of that contract.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from llm_train.runtime.base.launch_env import free_port  # noqa: F401 - the tests' port for each launch
from tests.launch_server import LaunchServer, ServedLaunch, servable
from tests.session_env import OFFLINE_ENV

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "llm_train" / "train.py"
WORKERS = REPO / "tests" / "workers.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")


def run_cmd(cmd: list[str], timeout: float = 900, env: dict[str, str] | None = None, cwd: Path = REPO):
    full_env = {**os.environ, **OFFLINE_ENV, **(env or {})}
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def accelerate_cmd(args: list[str], nproc: int) -> list[str]:
    """The `accelerate launch` command line of llm_train/train.py on N processes, on a fresh port."""
    return [
        str(ACCELERATE),
        "launch",
        "--num_processes",
        str(nproc),
        "--main_process_port",
        str(free_port()),
        str(TRAIN),
        *args,
    ]


def launch_cmd(args: list[str], nproc: int) -> list[str]:
    """N workers of llm_train/train.py ARGS, each given its rank in the environment as torchrun gives it."""
    return [sys.executable, str(WORKERS), str(nproc), str(TRAIN), *args]


def launch(args: list[str], nproc: int = 2, timeout: float = 900, env: dict[str, str] | None = None):
    """Run N workers of llm_train/train.py ARGS to the end (tests/workers.py, forked by tests/launch_server.py)."""
    served = _served(args, nproc, env, merge_stderr=False)
    if served is None:
        return run_cmd(launch_cmd(args, nproc), timeout=timeout, env=env)
    try:
        out, err = served.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(served.pid, signal.SIGKILL)
        served.wait()
        raise
    return subprocess.CompletedProcess(launch_cmd(args, nproc), served.wait(), out, err)


def _served(
    args: list[str], nproc: int, env: dict[str, str] | None, merge_stderr: bool
) -> ServedLaunch | None:
    """The launch forked by this pytest process's launch server, or None where a fresh one is needed."""
    full_env = {**os.environ, **OFFLINE_ENV, **(env or {})}
    if not servable(args, full_env):
        return None
    return LaunchServer.get().start([str(nproc), str(TRAIN), *args], full_env, merge_stderr)


def accelerate_launch(
    args: list[str], nproc: int = 2, timeout: float = 900, env: dict[str, str] | None = None
):
    """`accelerate launch --num_processes N llm_train/train.py ARGS` with no config file, on a fresh port."""
    cmd = accelerate_cmd(args, nproc)
    return run_cmd(cmd, timeout=timeout, env=env)


def train_py(args: list[str], timeout: float = 600, env: dict[str, str] | None = None):
    """`python llm_train/train.py ARGS` (one process)."""
    return run_cmd([sys.executable, str(TRAIN), *args], timeout=timeout, env=env)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nSTDOUT:\n{result.stdout[-4000:]}\nSTDERR:\n{result.stderr[-6000:]}"
    )


# A decoder's config.json fields small enough to build with transformers in a unit test, for any family
# (test_shapes and test_model_families count the planner's parameters against the built model).
TINY_DECODER_FIELDS: dict[str, object] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 176,
    "vocab_size": 50,
    "max_position_embeddings": 128,
}


def tiny_llama_config(**over: object):  # -> LlamaConfig
    """The unit tests' Llama: 2 layers, hidden 64, GQA (4 query heads, 2 key-value heads), a 256-token
    vocabulary; `over` changes any field (a test states only what it needs differently)."""
    from transformers import LlamaConfig

    fields: dict[str, object] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return LlamaConfig(**(fields | over))


def tiny_llama(vocab_size: int = 97, seed: int = 0, **over: object):  # -> LlamaForCausalLM
    """A smaller fp32 tiny_llama_config (hidden 32), eager attention: the losses' reference model."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    fields: dict[str, object] = {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
        "attn_implementation": "eager",
    }
    return LlamaForCausalLM(tiny_llama_config(**(fields | over))).float()


def make_tiny_pretrained(path: Path, seed: int = 0) -> Path:
    """A tiny-cpu-shaped Llama saved with save_pretrained: the fine-tuning path, on a local directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from llm_train.config.recipe import load_recipe

    recipe = load_recipe("tiny-cpu")
    fields = dict(recipe.model.config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(recipe.model.tokenizer).save_pretrained(path)
    return path


def launch_popen(args: list[str], nproc: int = 2) -> subprocess.Popen | ServedLaunch:
    """Like launch, but in the background and in its own process group (to signal or kill it)."""
    return _served(args, nproc, None, merge_stderr=True) or popen(launch_cmd(args, nproc))


def resume_after_kill_9(
    run_dir: Path, args: list[str], step: int, nproc: int = 2
) -> subprocess.CompletedProcess:
    """Launch `args` in the background, kill -9 the whole launch once `step` is logged, then launch them
    again (they carry --resume auto) and check it resumed from the newest committed checkpoint."""
    import time

    proc = launch_popen(args, nproc)
    assert wait_for_step(run_dir, step, proc), proc.communicate()[0][-4000:]
    time.sleep(0.3)
    assert proc.poll() is None, "the run ended before the kill: nothing was tested"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.returncode
    last = committed_step(run_dir)
    assert last is not None, "killed before the first checkpoint: nothing to resume"
    resumed = launch(args, nproc)
    assert_ok(resumed)
    assert_resumed(resumed.stdout, run_dir, last)
    return resumed


def accelerate_popen(
    args: list[str], nproc: int = 2, launcher_flags: tuple[str, ...] = ()
) -> subprocess.Popen:
    """Like accelerate_launch, but in the background and in its own process group (to signal or kill it).

    `launcher_flags` go to `accelerate launch` itself (e.g. --max_restarts), before the script.
    """
    cmd = accelerate_cmd(args, nproc)
    cmd[2:2] = launcher_flags
    return popen(cmd)


def popen(cmd: list[str]) -> subprocess.Popen:
    """`cmd` in the background, in its own process group, its output (stdout and stderr) in one pipe."""
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, **OFFLINE_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> bool:
    """Block until metrics.jsonl has logged `step` (True) or the process ended first (False)."""
    import time

    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.is_file():
            steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]
            if steps and max(steps) >= step:
                return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not logged within {timeout}s")


# What a worker says when it resumes (runtime/session.py restore): the checkpoint's path and its step.
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")


def committed_step(run_dir: Path) -> int | None:
    """The step of the newest complete checkpoint of a run directory (its `latest`), None before the first."""
    latest = run_dir / "checkpoints" / "latest"
    return int(latest.read_text().strip().split("-")[1]) if latest.is_file() else None


def assert_resumed(output: str, checkpoint_or_run_dir: Path, step: int) -> None:
    """The launch's last resume was from that checkpoint (a run directory: its step-`step` one) at `step`.

    Losses alone cannot show it: a relaunch that silently started from step 0 on deterministic data
    repeats the same losses, so every resume test also asserts where the run resumed.
    """
    from llm_train.runtime.checkpointing.commit import step_name

    target = checkpoint_or_run_dir
    if not target.name.startswith("step-"):
        target = target / "checkpoints" / step_name(step)
    found = RESUMED.findall(output)
    assert found, f"the launch did not say it resumed (expected {target} at step {step}):\n{output[-3000:]}"
    path, at = found[-1]
    assert (Path(path).resolve(), int(at)) == (target.resolve(), step), (found, target, step)


def wizard_config(path: Path, distributed_type: str, num_processes: int = 1, **fields: object) -> Path:
    """An accelerate config as `accelerate config` writes it: the ClusterConfig its wizard returns, saved.

    accelerate 1.15 commands/config/cluster.py: the questions fill a ClusterConfig, `to_yaml_file` writes
    it. `fields` are the wizard's answers (mixed_precision, use_cpu, deepspeed_config, mpirun_config, ...).
    """
    from accelerate.commands.config.config_args import ClusterConfig

    answers: dict[str, object] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed_type,
        "num_processes": num_processes,
        "mixed_precision": "no",
        "use_cpu": distributed_type == "MULTI_CPU",
        "debug": False,
        **fields,
    }
    ClusterConfig(**answers).to_yaml_file(str(path))  # type: ignore[arg-type]
    return path
