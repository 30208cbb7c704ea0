"""Tensor and pipeline parallelism on CPU against one single-process run of the same fine-tune.

One module-scoped fixture launches each configuration once; the tests read the run
directories. Every run fine-tunes the same saved tiny Qwen2 with warmup 0, the same seed
and the same global batch. Qwen2 with tied embeddings and grouped-query attention is the
harder case: the embedding is shared by the first and the last pipeline stage, and AutoTP
splits 4 query / 2 key-value heads and the q/k/v biases. (The layer-by-layer equivalence
of Llama, Mistral and Qwen2 is tested without DeepSpeed in tests/unit/test_pipeline_model.py.)

    reference   1 process              micro 8 x accum 2            (ZeRO-0)
    tp2         2 processes, AutoTP 2  micro 8 x accum 2 x dp 1     (ZeRO-1)
    tp2_zero0   tp2 on ZeRO-0 (llm_train measures the gradient norm across the TP slices)
    pp2         2 processes, 2 stages  micro 8 x accum 2 x dp 1     (ZeRO-1, checkpoint at step 3)
    pp2_resumed pp2 resumed from its step-3 checkpoint
    pp2_dp2     4 processes, 2 stages  micro 8 x accum 1 x dp 2     (ZeRO-0: llm_train's own clipping
                                                                  across stages, see runtime/engines/pipeline_engine.py;
                                                                  the chunked loss, memory.tiled_loss, on the
                                                                  last stage, through the tied embedding)

fp32 on CPU: splitting matrices (TP) or layers (PP) changes where numbers are computed, not
what they are, so the per-step losses agree within 1e-4 (measured: ~1e-6).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.reference import SHORT_RUN, STEPS
from tests.helpers import REPO, assert_ok, assert_resumed, launch, losses, read_metrics, train_py

pytestmark = pytest.mark.e2e

TOL = 1e-4


def make_tiny_qwen2(path: Path, seed: int = 0) -> Path:
    """A saved tiny Qwen2 (tied embeddings, 2 KV heads) with the bundled tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from llm_train.config.recipe import load_recipe

    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(load_recipe("tiny-cpu").model.tokenizer).save_pretrained(path)
    return path


def _args(recipe: str, run_dir: Path, pretrained: Path, accum: int, *extra: str) -> list[str]:
    return [
        "--recipe",
        recipe,
        "--output-dir",
        str(run_dir),
        *SHORT_RUN,
        f"optim.grad_accum={accum}",
        "model.init=pretrained",
        f"model.name_or_path={pretrained}",
        "model.config={}",  # the recipes' own tiny-Llama fields do not apply to this model
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from llm_train.runtime.checkpointing.commit import step_name

    base = tmp_path_factory.mktemp("parallel")
    pretrained = make_tiny_qwen2(base / "pretrained")
    out = {name: base / name for name in ("reference", "tp2", "tp2_zero0", "pp2", "pp2_resumed", "pp2_dp2")}
    assert_ok(train_py(_args("tiny-cpu", out["reference"], pretrained, 2, "--ds-config", "zero0")))
    assert_ok(launch(_args("tiny-cpu-tp2", out["tp2"], pretrained, 2)))
    # ZeRO-0 keeps no gradient norm: llm_train measures it, over the TP slices and the copies.
    zero0_tp = json.loads((REPO / "ds_configs" / "zero1_tp.json").read_text())
    zero0_tp["zero_optimization"] = {"stage": 0}
    (base / "zero0_tp.json").write_text(json.dumps(zero0_tp))
    tp2_zero0 = _args(
        "tiny-cpu-tp2", out["tp2_zero0"], pretrained, 2, "--ds-config", str(base / "zero0_tp.json")
    )
    assert_ok(launch(tp2_zero0))
    assert_ok(launch(_args("tiny-cpu-pp2", out["pp2"], pretrained, 2, "checkpoint.every_steps=3")))
    checkpoint = out["pp2"] / "checkpoints" / step_name(3)
    resumed = launch(_args("tiny-cpu-pp2", out["pp2_resumed"], pretrained, 2, "--resume", str(checkpoint)))
    assert_ok(resumed)
    assert_resumed(resumed.stdout, checkpoint, 3)
    # The chunked loss on the last stage (memory.tiled_loss): the same losses as the dense one.
    pp2_dp2 = _args(
        "tiny-cpu-pp2", out["pp2_dp2"], pretrained, 1, "--ds-config", "zero0", "memory.tiled_loss=true"
    )
    assert_ok(launch(pp2_dp2, nproc=4))
    return out


def _world(run_dir: Path) -> list[dict[str, Any]]:
    world = json.loads((run_dir / "world.json").read_text())
    return sorted(world["ranks"], key=lambda r: r["rank"])


@pytest.mark.parametrize("name", ["tp2", "tp2_zero0", "pp2", "pp2_dp2"])
def test_losses_equal_the_single_process_run(runs: dict[str, Path], name: str) -> None:
    reference, candidate = losses(runs["reference"]), losses(runs[name])
    assert sorted(candidate) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert candidate[step] == pytest.approx(reference[step], abs=TOL), (step, reference, candidate)
    assert candidate[STEPS] < candidate[1] - 0.3  # it learns
    # The clipped global gradient norm sees every shard and stage exactly once.
    norms = [
        {m["step"]: m["grad_norm"] for m in read_metrics(runs[n]) if "loss" in m} for n in ("reference", name)
    ]
    for step in range(1, STEPS + 1):
        assert norms[1][step] == pytest.approx(norms[0][step], abs=1e-3), (step, norms)


def test_the_processes_formed_the_planned_grid(runs: dict[str, Path]) -> None:
    # TP: both ranks are data-parallel rank 0 (same batches); PP: DeepSpeed's pipe-major topology.
    assert [r["dp_rank"] for r in _world(runs["tp2"])] == [0, 0]
    assert [(r["stage"], r["dp_rank"]) for r in _world(runs["pp2"])] == [(0, 0), (1, 0)]
    assert [(r["stage"], r["dp_rank"]) for r in _world(runs["pp2_dp2"])] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("name", ["tp2", "pp2", "pp2_dp2"])
def test_run_directory_contract(runs: dict[str, Path], name: str) -> None:
    run_dir = runs[name]
    ds = json.loads((run_dir / "config" / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == (0 if name == "pp2_dp2" else 1) and '"auto"' not in json.dumps(
        ds
    )
    assert (run_dir / "config" / "recipe.yaml").is_file()
    for row in (m for m in read_metrics(run_dir) if "loss" in m):
        # The pipeline loop meters like the ZeRO loop: the same throughput and memory fields.
        meter = {"tokens_per_s", "tokens_per_s_per_gpu", "samples_per_s", "step_time_s", "host_rss_gib"}
        assert {"step", "loss", "lr", "grad_norm", *meter} <= set(row)
        assert row["tokens_per_s"] > 0 and row["grad_norm"] == row["grad_norm"]  # not NaN
    assert json.loads((run_dir / "final" / "export_check.json").read_text())["ok"]


def test_pipeline_resume_continues_the_curve(runs: dict[str, Path]) -> None:
    import torch
    from safetensors.torch import load_file

    uninterrupted, resumed = losses(runs["pp2"]), losses(runs["pp2_resumed"])
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(uninterrupted[step], abs=1e-6), (step, uninterrupted, resumed)
    for shard in sorted((runs["pp2"] / "final").glob("*.safetensors")):
        a, b = load_file(shard), load_file(runs["pp2_resumed"] / "final" / shard.name)
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def _eval_loss_of_export(final: Path, recipe: str) -> float:
    """The exported model, loaded by plain transformers, on the eval batches the run evaluated."""
    import torch
    from transformers import AutoModelForCausalLM

    from llm_train.config.recipe import load_recipe
    from llm_train.data import eval_batches, load_blocks
    from llm_train.runtime.model.model import load_tokenizer

    r = load_recipe(recipe, ["eval.batches=2"])
    _, eval_split = load_blocks(r.data, load_tokenizer(r.model), r.optim.seed)
    batches = eval_batches(eval_split, r.optim.micro_batch_size, 0, 1, r.eval.batches)
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    with torch.no_grad():
        return float(torch.stack([model(**b).loss for b in batches]).mean())


@pytest.mark.parametrize(("name", "recipe"), [("tp2", "tiny-cpu-tp2"), ("pp2", "tiny-cpu-pp2")])
def test_export_equals_the_training_model(runs: dict[str, Path], name: str, recipe: str) -> None:
    # eval_loss at the last step was computed by the sharded training engine; the export must agree.
    logged = [m["eval_loss"] for m in read_metrics(runs[name]) if "eval_loss" in m][-1]
    assert _eval_loss_of_export(runs[name] / "final", recipe) == pytest.approx(logged, abs=1e-5)


@pytest.mark.parametrize("name", ["tp2", "pp2", "pp2_dp2"])
def test_export_is_a_plain_hf_model_with_the_reference_logits(runs: dict[str, Path], name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    def logits(run_dir: Path) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(run_dir / "final", dtype=torch.float32).eval()
        with torch.no_grad():
            return model(torch.arange(3, 67).view(2, 32)).logits

    expected, got = logits(runs["reference"]), logits(runs[name])
    assert got.shape == (2, 32, 4096)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)


def test_llm_train_export_reads_a_pipeline_checkpoint(runs: dict[str, Path], tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from llm_train.runtime.checkpointing.commit import step_name
    from llm_train.runtime.export.from_checkpoint import export_checkpoint

    report = export_checkpoint(runs["pp2"] / "checkpoints" / step_name(STEPS), tmp_path / "out", "fp32")
    expected = json.loads((runs["pp2"] / "final" / "export_check.json").read_text())["tensors"]
    assert report["tensors"] == expected and report["max_logit_diff"] <= 1e-4
    exported = load_file(tmp_path / "out" / "model.safetensors")
    final: dict[str, torch.Tensor] = {}
    for shard in (runs["pp2"] / "final").glob("*.safetensors"):
        final.update(load_file(shard))
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)
