"""A run is resolved once per process; what is known later changes it by value (`Resolved.refine`).

Two specifications: a refinement gives exactly the run a fresh resolution with the same value as
an override string gives (the recipe, the layout and the DS JSON, key order included, since
config/ds_config.json is written from it), and a worker's start-up, through train.main and the
session's `settle_run`, with every late change at once (deepspeed.pinning=auto, optim.epochs,
a resume on another layout that keeps the checkpoint's batch and loads the universal copy,
--flops-profiler), parses the recipe once, detects the device once and plans the resume once.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from llm_train import DS_CONFIGS_DIR, train
from llm_train.config import resolution
from llm_train.config.hardware import Device
from llm_train.config.resolution import Resolved, resolve_run, steps_for_epochs
from llm_train.observability.profiling import flops_profiler_config
from llm_train.runtime import session
from llm_train.runtime.checkpointing import resume
from llm_train.runtime.checkpointing.resume import Resume
from llm_train.runtime.session import RunOptions
from tests.devices import CPU

EPOCHS = ["optim.max_steps=null", "optim.epochs=2"]


@pytest.fixture
def scheduled(tmp_path: Path) -> str:
    """ZeRO-3 with DeepSpeed's own LR schedule, whose length is optim.max_steps: a JSON value steps change."""
    config = json.loads((DS_CONFIGS_DIR / "zero3.json").read_text())
    auto = dict.fromkeys(("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"), "auto")
    config["scheduler"] = {"type": "WarmupDecayLR", "params": auto}
    path = tmp_path / "zero3_scheduled.json"
    path.write_text(json.dumps(config))
    return str(path)


def _same(refined: Resolved, fresh: Resolved) -> None:
    assert refined.recipe.model_dump(mode="json") == fresh.recipe.model_dump(mode="json")
    assert refined.layout == fresh.layout
    assert json.dumps(refined.ds_config) == json.dumps(fresh.ds_config)  # key order too: ds_config.json
    assert (refined.hidden_size, refined.model_fields, refined.attention, refined.notice) == (
        fresh.hidden_size,
        fresh.model_fields,
        fresh.attention,
        fresh.notice,
    )


def test_steps_from_epochs_refine_like_a_fresh_resolution(scheduled: str) -> None:
    run = resolve_run("tiny-cpu", EPOCHS, world_size=2, device=CPU, ds_config_path=scheduled)
    assert run.ds_config["scheduler"]["params"]["total_num_steps"] == 0  # not known before the data
    refined = run.refine(max_steps=37)
    fresh = resolve_run("tiny-cpu", EPOCHS, world_size=2, device=CPU, ds_config_path=scheduled, max_steps=37)
    _same(refined, fresh)
    assert refined.ds_config["scheduler"]["params"]["total_num_steps"] == 37
    assert (
        run.ds_config["scheduler"]["params"]["total_num_steps"] == 0
    )  # a new value; the old one is as it was


def test_a_kept_batch_refines_the_accumulation_like_a_fresh_resolution() -> None:
    run = resolve_run("tiny-cpu", [], world_size=1, device=CPU)
    refined = run.refine(grad_accum=2)
    _same(refined, resolve_run("tiny-cpu", ["optim.grad_accum=2"], world_size=1, device=CPU))
    assert refined.layout.global_batch_size == 16 and refined.ds_config["train_batch_size"] == 16


def test_a_decided_pinning_refines_like_a_fresh_resolution() -> None:
    ds = "zero3_offload"
    run = resolve_run("tiny-cpu", ["deepspeed.pinning=auto"], world_size=2, device=CPU, ds_config_path=ds)
    refined = run.refine(pinning="off", notice="pinning decided")
    fresh = resolve_run("tiny-cpu", ["deepspeed.pinning=off"], world_size=2, device=CPU, ds_config_path=ds)
    assert refined.notice == "pinning decided" and fresh.notice is None
    _same(dataclasses.replace(refined, notice=None), fresh)
    assert refined.ds_config["zero_optimization"]["offload_optimizer"]["pin_memory"] is False


def test_universal_loading_and_the_flops_profiler_are_added_to_a_new_config(tmp_path: Path) -> None:
    run = resolve_run("tiny-cpu", [], world_size=2, device=CPU)
    section = flops_profiler_config("3-4", tmp_path)
    refined = run.refine(load_universal=True, flops_profiler=section)
    # What the session used to write into the DS JSON after resolution, in the same order.
    expected = {
        **run.ds_config,
        "checkpoint": {**run.ds_config.get("checkpoint", {}), "load_universal": True},
    }
    expected["flops_profiler"] = section
    assert json.dumps(refined.ds_config) == json.dumps(expected)
    assert "flops_profiler" not in run.ds_config and "checkpoint" not in run.ds_config
    # Later refinements keep them: every refinement starts from the basis, which now carries them.
    assert refined.refine(max_steps=5).ds_config["checkpoint"] == {"load_universal": True}


def _checkpoint_of_a_two_process_run(out: Path) -> None:
    """A committed-looking checkpoint written by tiny-cpu on 2 processes (only its manifest is read here)."""
    written = resolve_run("tiny-cpu", [], world_size=2, device=CPU)
    ckpt = out / "checkpoints" / "step-00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"step": 2, "layout": written.layout.as_dict()}))
    (out / "checkpoints" / "latest").write_text(ckpt.name)


def test_a_worker_resolves_once(tmp_path: Path, scheduled: str, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    _checkpoint_of_a_two_process_run(out)
    counts = {"recipe parsed": 0, "device detected": 0, "layouts compared": 0}

    def counted(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(resolution, "load_recipe", counted("recipe parsed", resolution.load_recipe))
    monkeypatch.setattr(Device, "detect", staticmethod(counted("device detected", Device.detect)))
    monkeypatch.setattr(resume, "bridge", counted("layouts compared", resume.bridge))
    settled: list[Resolved] = []

    def worker_start(run: Resolved, options: RunOptions, plan: Resume, say: session.Say) -> int:
        """run_training up to the engine: the run as the worker settles it."""
        settled.append(session.settle_run(run, options, 0, say)[0])
        return 0

    monkeypatch.setattr(train, "run_training", worker_start)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")  # a worker of a world of one
    argv = ["--recipe", "tiny-cpu", "--ds-config", scheduled, "--output-dir", str(out), "--resume", "auto"]
    assert train.main([*argv, "--flops-profiler", *EPOCHS, "deepspeed.pinning=auto"]) == 0

    assert counts == {"recipe parsed": 1, "device detected": 1, "layouts compared": 1}
    (run,) = settled
    # Every late change arrived, by value: dp 2 -> 1 keeps the batch of 16 with accumulation 2 ...
    assert run.layout.grad_accum == 2 and run.layout.global_batch_size == 16
    assert run.recipe.deepspeed.pinning in ("torch", "native", "off")  # decided, never "auto"
    assert run.ds_config["checkpoint"] == {"load_universal": True}
    assert run.ds_config["flops_profiler"]["enabled"] is True
    # ... and optim.epochs=2 counted with that accumulation, on one rank's share of the data.
    stream = session.build_data(run, 0, print).stream
    steps = steps_for_epochs(2.0, stream.per_epoch, 2)
    assert run.recipe.optim.max_steps == steps == run.ds_config["scheduler"]["params"]["total_num_steps"]
    assert steps < steps_for_epochs(2.0, stream.per_epoch, 1)  # not the launch's own accumulation of 1


def _count_estimates(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every call of the memory estimate from now on, wherever a module imported it from."""
    import sys

    from llm_train.planning.memory.estimate import estimate_memory

    calls: list[object] = []
    real = estimate_memory

    def counted(inp: Any) -> Any:
        calls.append(inp)
        return real(inp)

    for module in list(sys.modules.values()):
        if getattr(module, "estimate_memory", None) is real:
            monkeypatch.setattr(module, "estimate_memory", counted)
    return calls


@pytest.mark.parametrize("pinning", ["off", "auto"])
def test_a_run_start_estimates_its_memory_once(
    pinning: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The host-RAM, NVMe and memlock checks and the start-up summary read one estimate (guards.estimate_run):
    # they cannot disagree, and a worker does not estimate the run three to five times before it trains.
    # deepspeed.pinning=auto estimates the pinning it weighs; the chosen one is the run's estimate.
    from llm_train.observability.console import startup_summary

    calls = _count_estimates(monkeypatch)
    summaries: list[str] = []

    def worker_start(run: Resolved, options: RunOptions, plan: Resume, say: session.Say) -> int:
        """run_training up to the summary: the settled run, summarised with the estimate the checks read."""
        settled = session.settle_run(run, options, 0, say)[0]
        startup_summary(settled, summaries.append, estimated=options.estimate)
        return 0

    monkeypatch.setattr(train, "run_training", worker_start)
    # A GPU worker (the summary estimates only there); nothing here touches CUDA.
    monkeypatch.setattr(Device, "detect", staticmethod(lambda: Device("cuda", "H100", True)))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--recipe", "tiny-cpu", "--ds-config", "zero3_offload", "--output-dir", str(tmp_path / "run")]
    assert train.main([*argv, f"deepspeed.pinning={pinning}", "memory.attention=sdpa"]) == 0
    assert len(calls) == 1 and any("per GPU" in line for line in summaries)


def test_the_start_up_summary_reuses_the_estimate_of_the_same_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from llm_train.observability.console import startup_summary
    from llm_train.planning.search.guards import estimate_run

    run = resolve_run("tiny-cpu", [], world_size=1, device=Device("cuda", "H100", True))
    known = estimate_run(run)
    calls = _count_estimates(monkeypatch)
    lines: list[str] = []
    startup_summary(run, lines.append, estimated=known)
    assert not calls and any("per GPU" in line for line in lines)
    startup_summary(run.refine(grad_accum=4), lines.append, estimated=known)  # another run: its own estimate
    assert len(calls) == 1
