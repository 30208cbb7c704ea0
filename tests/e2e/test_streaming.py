"""A streamed corpus trains on 2 processes, and a stopped run resumes at exactly the next sequence.

tiny-cpu reads a local 3-file jsonl corpus with `streaming: true`. The reference trains 6
steps in one launch; the other trains 3, checkpoints at its end and is relaunched with
`--resume auto` for steps 4-6. A constant learning rate makes the two schedules identical, so
every per-step loss must match bit for bit (the same sequences in the same order on each
rank), and both runs must end at the same saved stream position.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_train import ASSETS_DIR
from tests.helpers import assert_ok, assert_resumed, launch, losses

pytestmark = pytest.mark.e2e

STEPS, STOP = 6, 3
GLOBAL_MICRO = 4 * 2  # micro_batch_size x data-parallel ranks


def _corpus(folder: Path) -> Path:
    """The bundled corpus's paragraphs as three jsonl files (600 rows: one pass is ~30 steps)."""
    paragraphs = [
        p.strip() for p in (ASSETS_DIR / "tiny" / "corpus.txt").read_text().split("\n\n") if p.strip()
    ]
    folder.mkdir()
    for f in range(3):
        rows = paragraphs[f * 200 : (f + 1) * 200]
        (folder / f"part-{f}.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return folder


def _args(run_dir: Path, corpus: Path, cache: Path, steps: int) -> list[str]:
    return [
        "--recipe",
        "tiny-cpu",
        "--output-dir",
        str(run_dir),
        f"data.train=[{{path: {corpus}, streaming: true}}]",
        "data.eval_fraction=0",
        f"data.cache_dir={cache}",
        "data.seq_len=64",
        "optim.micro_batch_size=4",
        "optim.schedule=constant",
        "optim.warmup_steps=0",
        f"optim.max_steps={steps}",
        "deepspeed.config=zero2",
        "output.sample_prompt=null",
        "output.log_every=1",
        "checkpoint.at_end=true",
    ]


def _data_state(run_dir: Path, step: int) -> list[dict]:
    trainer = run_dir / "checkpoints" / f"step-{step:08d}" / "trainer"
    return [json.loads(p.read_text())["data"] for p in sorted(trainer.glob("rank*.json"))]


def test_a_streamed_run_resumes_without_repeating_or_skipping(tmp_path: Path) -> None:
    corpus, cache = _corpus(tmp_path / "corpus"), tmp_path / "cache"
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    assert_ok(launch(_args(reference, corpus, cache, STEPS)))
    first = launch(_args(resumed, corpus, cache, STOP))
    assert_ok(first)
    assert "data.train is streamed" in first.stdout + first.stderr
    stopped = _data_state(resumed, STOP)
    assert len(stopped) == 2 and stopped[0] == stopped[1]  # both ranks saved the same global position
    assert stopped[0]["kind"] == "stream" and stopped[0]["sequences_consumed"] == STOP * GLOBAL_MICRO
    result = launch(_args(resumed, corpus, cache, STEPS) + ["--resume", "auto"])
    assert_ok(result)
    assert_resumed(result.stdout, resumed, STOP)

    expected = losses(reference)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert losses(resumed) == expected  # exact: the same sequences, in the same order, on each rank
    assert _data_state(resumed, STEPS) == _data_state(reference, STEPS)
    assert _data_state(reference, STEPS)[0]["sequences_consumed"] == STEPS * GLOBAL_MICRO
