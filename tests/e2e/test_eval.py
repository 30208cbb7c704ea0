"""`llm-train eval`: lm-evaluation-harness on a trained run, its checkpoint and its export, into the run.

One short tiny-cpu run (real 2-process ZeRO-3, TensorBoard on, a checkpoint every 10 steps) is
evaluated on the bundled offline task. The numbers must be lm-eval's own: its CLI is run on the same
exported model and task in the same test and gives the same values; a checkpoint goes through the
verified export first; the results land in the run directory and its trackers at the step of the
weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from llm_train import cli
from tests.helpers import assert_ok, launch, read_metrics, run_cmd
from tests.optional import require

pytestmark = pytest.mark.e2e

LM_EVAL = Path(sys.executable).with_name("lm_eval")
TASKS = Path(__file__).resolve().parents[2] / "llm_train" / "assets" / "eval_tasks"
# 16 of the task's 32 items (64 loglikelihood requests) keep each evaluation to seconds on CPU.
SAME = ["--limit", "16", "--batch-size", "16"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require("lm_eval")
    out = tmp_path_factory.mktemp("eval") / "run"
    args = ["--recipe", "tiny-cpu", "--output-dir", str(out), "--max-steps", "20", "optim.warmup_steps=2"]
    args += ["checkpoint.every_steps=10", "eval.every=0", "eval.batches=1", "output.sample_prompt=null"]
    assert_ok(launch([*args, "tracking.tensorboard=true"]))
    return out


def _scalars(run_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {}


def _eval(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """`llm-train eval ARGS` in this process (the imports are the test's own); its stdout."""
    assert cli.main(["eval", *args, "--tasks", "llm_train_tiny", *SAME]) == 0
    return capsys.readouterr().out


def test_eval_of_a_run_gives_lm_evals_own_numbers_into_the_run(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stdout = _eval(capsys, str(run_dir))
    ours = json.loads((run_dir / "eval" / "step-00000020.json").read_text())
    assert ours["step"] == 20 and ours["model"] == str(run_dir / "final")
    # lm-eval's own CLI, on the run's export and the bundled task.
    cli = [str(LM_EVAL), "--model", "hf", "--model_args", f"pretrained={run_dir / 'final'},dtype=float32"]
    cli += ["--include_path", str(TASKS), "--tasks", "llm_train_tiny", "--device", "cpu"]
    cli += ["--limit", "16", "--batch_size", "16", "--output_path", str(tmp_path / "lm_eval")]
    assert_ok(run_cmd(cli, timeout=600))
    theirs = json.loads(next((tmp_path / "lm_eval").rglob("results_*.json")).read_text())["results"]
    want = theirs["llm_train_tiny"]
    assert ours["tasks"]["llm_train_tiny"] == {
        "acc": want["acc,none"],
        "acc_stderr": want["acc_stderr,none"],
        "acc_norm": want["acc_norm,none"],
        "acc_norm_stderr": want["acc_norm_stderr,none"],
    }
    assert ours["samples"] == {"llm_train_tiny": 16}
    # The table beside it and on the console; the trackers at step 20, the step final/ holds.
    table = (run_dir / "eval" / "step-00000020.md").read_text()
    assert "|llm_train_tiny|" in table and table.split("\n", 2)[2] in stdout
    logged = [m for m in read_metrics(run_dir) if "bench/llm_train_tiny/acc" in m]
    assert [m["step"] for m in logged] == [20]
    assert logged[0]["bench/llm_train_tiny/acc_stderr"] == want["acc_stderr,none"]
    assert _scalars(run_dir, "bench/llm_train_tiny/acc") == pytest.approx({20: want["acc,none"]})


def test_eval_of_a_checkpoint_exports_it_first_and_logs_at_its_step(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = run_dir / "checkpoints" / "step-00000010"
    stdout = _eval(capsys, str(ckpt))
    export = run_dir / "exports" / "step-00000010"
    assert json.loads((export / "export_check.json").read_text())["ok"]  # the verified export's check
    assert f"exported {ckpt} -> {export}" in stdout
    ours = json.loads((run_dir / "eval" / "step-00000010.json").read_text())
    assert ours["step"] == 10 and ours["model"] == str(export)
    logged = {m["step"] for m in read_metrics(run_dir) if "bench/llm_train_tiny/acc" in m}
    assert 10 in logged
    assert 10 in _scalars(run_dir, "bench/llm_train_tiny/acc")
    # A second evaluation reuses the export (no second conversion).
    assert "exported" not in _eval(capsys, str(export), "--no-trackers")
    assert json.loads((run_dir / "eval" / "step-00000010.json").read_text())["tasks"] == ours["tasks"]
