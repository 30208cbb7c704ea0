"""Image-text checkpoints fine-tuned on text: every family a tiny random config builds trains, exports and reloads.

Each family (tests/image_text_models.py: hidden 32, one layer, a one-layer vision tower, the bundled tokenizer)
is saved as a hub checkpoint with processor files beside it, then trained 3 steps of tiny-cpu's text on one
process with ZeRO-0, its default freeze (vision tower and projector). The run verifies its own export (keys
as from_pretrained reports them, logits against the training process's); the test then checks what a user
relies on: final/ has the input's architecture, tensor names and shapes, and processor files; it loads with
AutoModelForImageTextToText and with the class config.json names, nothing missing or unexpected; the frozen
vision tower and projector are bit-identical to the input and the language model moved. One more run trains
Gemma 3 (the issue's failing export) on 2 processes of ZeRO-3 and exports its checkpoint with `llm-train
export`, which must give the same tensors as the run's final/ and carry the processor files too; Qwen2.5-VL
trains under ZeRO-2 without and with CPU offload and ZeRO-3 with it, and Gemma 3 with LoRA under ZeRO-3 (merged export, the
vision tower's q_proj/k_proj/v_proj left without adapters, so bit-identical too).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from llm_train.runtime.model.parts import part_of
from tests.helpers import REPO, assert_ok, launch, losses, run_cmd
from tests.image_text_models import build_checkpoint, family_configs

pytestmark = pytest.mark.e2e

TOKENIZER = REPO / "llm_train" / "assets" / "tiny" / "tokenizer"
# Stand-ins for a hub checkpoint's processor files: copied byte for byte, so their content is arbitrary. (Its
# chat template is the tokenizer's: the run saves the tokenizer it trained with, tiny-cpu's bundled one.)
PROCESSOR = {
    "preprocessor_config.json": '{"image_processor_type": "SiglipImageProcessor", "size": {"height": 28}}\n',
    "processor_config.json": '{"processor_class": "Gemma3Processor", "image_seq_length": 4}\n',
}


def checkpoint(model_type: str, root: Path) -> Path:
    out = build_checkpoint(model_type, root / model_type, TOKENIZER)
    for name, text in PROCESSOR.items():
        (out / name).write_text(text)
    return out


def run_args(source: Path, run_dir: Path, *extra: str, recipe: str = "tiny-cpu") -> list[str]:
    return [
        "--recipe",
        recipe,
        "--output-dir",
        str(run_dir),
        "--max-steps",
        "3",
        "model.init=pretrained",
        f"model.name_or_path={source}",
        "model.config={}",  # tiny-cpu's Llama fields would reshape the checkpoint: refused, so cleared
        "data.seq_len=32",
        "optim.micro_batch_size=2",
        "optim.warmup_steps=1",
        "output.log_every=1",
        "eval.every=0",
        *extra,
    ]


def tensors(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def assert_export_keeps_the_input(source: Path, final: Path) -> None:
    """Architecture, names, shapes and processor files as the input's; frozen parts bit-identical."""
    import torch
    import transformers

    before, after = tensors(source), tensors(final)
    assert {k: tuple(v.shape) for k, v in after.items()} == {k: tuple(v.shape) for k, v in before.items()}
    architecture = json.loads((source / "config.json").read_text())["architectures"]
    assert json.loads((final / "config.json").read_text())["architectures"] == architecture
    for name, text in PROCESSOR.items():
        assert (final / name).read_text() == text
    frozen = [k for k in before if part_of(k) in ("vision_tower", "projector")]
    trained = [k for k in before if part_of(k) == "language_model"]
    assert frozen and trained
    assert all(torch.equal(before[k], after[k]) for k in frozen)
    assert any(not torch.equal(before[k], after[k]) for k in trained)  # text trained the language model
    for cls in (transformers.AutoModelForImageTextToText, getattr(transformers, architecture[0])):
        model, info = cls.from_pretrained(final, output_loading_info=True)
        assert type(model).__name__ == architecture[0]
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.parametrize("model_type", sorted(family_configs()))
def test_an_image_text_family_fine_tunes_on_text_and_exports_whole(model_type: str, tmp_path: Path) -> None:
    source = checkpoint(model_type, tmp_path)
    run_dir = tmp_path / "run"
    result = launch(run_args(source, run_dir, "deepspeed.config=zero0"), nproc=1)
    assert_ok(result)
    assert sorted(losses(run_dir)) == [1, 2, 3]
    assert "verified: loads with no missing, unexpected or mismatched keys; logits" in result.stdout
    assert_export_keeps_the_input(source, run_dir / "final")


def test_gemma3_on_two_zero3_ranks_exports_its_run_and_its_checkpoint(tmp_path: Path) -> None:
    import torch

    source = checkpoint("gemma3", tmp_path)
    run_dir = tmp_path / "run"
    result = launch(run_args(source, run_dir), nproc=2)  # tiny-cpu's own deepspeed.config: zero3
    assert_ok(result)
    assert json.loads((run_dir / "world.json").read_text())["world_size"] == 2
    assert_export_keeps_the_input(source, run_dir / "final")

    out = tmp_path / "exported"
    exported = run_cmd(
        [
            str(Path(sys.executable).with_name("llm-train")),
            "export",
            str(run_dir),
            str(out),
            "--dtype",
            "fp32",
        ]
    )
    assert_ok(exported)
    assert_export_keeps_the_input(source, out)
    final, again = tensors(run_dir / "final"), tensors(out)
    assert all(
        torch.equal(final[k], again[k]) for k in final
    )  # an fp32 run exported in fp32: the same weights


@pytest.mark.parametrize("ds_config", ["zero2", "zero2_offload", "zero3_offload"])
def test_zero2_and_offloaded_layouts_train_an_image_text_model(ds_config: str, tmp_path: Path) -> None:
    source = checkpoint("qwen2_5_vl", tmp_path)
    run_dir = tmp_path / "run"
    result = launch(run_args(source, run_dir, f"deepspeed.config={ds_config}"), nproc=1)
    assert_ok(result)
    assert ("offload      optimizer=cpu" in result.stdout) == ds_config.endswith("offload")
    assert_export_keeps_the_input(source, run_dir / "final")


def test_lora_on_an_image_text_model_adapts_the_language_model_and_exports_merged(tmp_path: Path) -> None:
    import torch

    source = checkpoint("gemma3", tmp_path)
    run_dir = tmp_path / "run"
    result = launch(run_args(source, run_dir, "deepspeed.config=zero3", recipe="tiny-cpu-lora"), nproc=1)
    assert_ok(result)
    assert "export: merged shard by shard" in result.stdout
    assert_export_keeps_the_input(source, run_dir / "final")

    # `llm-train export --merge` of its checkpoint: the base loaded again, the adapters folded in, verified
    # against the logits the training engine recorded; the same model as final/ up to fp32 summation order.
    out = tmp_path / "merged"
    command = ["export", str(run_dir), str(out), "--dtype", "fp32", "--merge"]
    exported = run_cmd([str(Path(sys.executable).with_name("llm-train")), *command])
    assert_ok(exported)
    assert "compared with the logits the training engine recorded" in exported.stdout
    assert_export_keeps_the_input(source, out)
    final, again = tensors(run_dir / "final"), tensors(out)
    assert all(torch.allclose(final[k], again[k], rtol=0, atol=1e-6) for k in final)

    # Without --merge: the adapter, placed as the run placed it (not on the vision tower's q_proj/v_proj), so
    # PEFT on the input checkpoint rebuilds the same model.
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    adapter = tmp_path / "adapter"
    exported = run_cmd(
        [str(Path(sys.executable).with_name("llm-train")), "export", str(run_dir), str(adapter)]
    )
    assert_ok(exported)
    assert json.loads((adapter / "adapter_config.json").read_text())["exclude_modules"]
    base = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32)
    rebuilt = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    rebuilt_weights = dict(rebuilt.named_parameters())
    merged = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    assert all(torch.allclose(p, rebuilt_weights[n], rtol=0, atol=1e-6) for n, p in merged.named_parameters())
