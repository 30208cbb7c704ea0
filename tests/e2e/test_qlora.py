"""QLoRA end to end: a 4-bit (bitsandbytes NF4) base under 2-process DeepSpeed on CPU, ZeRO-2 and ZeRO-3.

bitsandbytes' CPU backend runs the same Linear4bit layers a GPU run uses. The base is a tiny
Llama saved with save_pretrained (quantisation happens as a checkpoint loads). Checked here:
the loss falls, the base stays 4-bit and frozen, only adapters change, the merged export loads
in plain transformers, the adapter export reloads with PEFT onto the quantised base and gives
the run's own logits, and a kill -9 + `--resume auto` continues bit for bit. Under ZeRO-3 the run
is the 70B two-card recipe's path (recipes/70b-qlora-2x4090.yaml): the base staged on the host,
partitioned by zero.Init(module=...) with its partitions offloaded (zero3_offload), each rank
holding half of the packed bytes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    assert_ok,
    launch,
    losses,
    make_tiny_pretrained,
    resume_after_kill_9,
)
from tests.optional import import_or_skip

import_or_skip("peft")
import_or_skip("bitsandbytes")

pytestmark = pytest.mark.e2e

STEPS = 6
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("qlora") / "base", seed=3)


def _args(run_dir: Path, base: Path, *extra: str) -> list[str]:
    return [
        "--recipe",
        "tiny-cpu-lora",
        "--output-dir",
        str(run_dir),
        f"--max-steps={STEPS}",
        "model.init=pretrained",
        f"model.name_or_path={base}",
        "lora.quantize=nf4",
        "optim.warmup_steps=0",
        "output.log_every=1",
        "output.sample_prompt=null",
        "eval.every=3",  # an eval mid-run: bitsandbytes' CPU inference repacking must stay off
        "eval.batches=2",
        *extra,
    ]


def _quantized_base(base: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from llm_train.config.recipe_sections import LoraSection
    from llm_train.runtime.model.quantized_base import keep_training_layout, quantization_config

    model = AutoModelForCausalLM.from_pretrained(
        base,
        quantization_config=quantization_config(LoraSection(quantize="nf4"), torch.float32),
        dtype=torch.float32,
    )
    keep_training_layout(model)
    return model


HELD = re.compile(r"held ([\d.]+)% / ([\d.]+)% by ranks 0 / 1 \(on (\w+)\)")


def test_qlora_zero3_offload_partitions_the_base_trains_resumes_exactly_and_exports_a_plain_model(
    base: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    extra = (
        "deepspeed.config=zero3_offload",
        "memory.activation_checkpointing=true",
        "checkpoint.every_steps=2",
        "--resume",
        "auto",
    )
    out, killed = tmp_path / "z3", tmp_path / "killed"
    result = launch(_args(out, base, *extra))
    assert_ok(result)
    world = json.loads((out / "world.json").read_text())
    assert world["world_size"] == 2 and [r["rank"] for r in world["ranks"]] == [0, 1]
    # Every projection of the 4 layers is a bitsandbytes 4-bit layer, and ZeRO-3 partitioned their packed
    # bytes: each rank's share, measured on its parameters' partitions, is half (ZeRO pads each tensor to a
    # multiple of the 2 ranks, a few bytes in 425,984; the log rounds to 0.1%), kept on the host (offload).
    assert "base model: 28 linear layers in nf4 (bitsandbytes)" in result.stdout, result.stdout[-3000:]
    held = HELD.search(result.stdout)
    assert held is not None, result.stdout[-3000:]
    assert abs(float(held[1]) - 50) <= 0.1 and abs(float(held[2]) - 50) <= 0.1 and held[3] == "cpu", held[0]
    run_losses = list(losses(out).values())
    assert len(run_losses) == STEPS and run_losses[-1] < run_losses[0], run_losses
    # Checkpoints carry the adapters, not the frozen 4-bit base.
    saved = torch.load(
        next((out / "checkpoints").glob("step-*/state/*/*mp_rank_00_model_states.pt")), weights_only=False
    )["module"]
    frozen = [k for k in saved if k.endswith(".weight") and "lora_" not in k]
    assert not frozen and any("lora_A" in k for k in saved), sorted(saved)[:5]

    # The merged export: a plain 16-bit model that loads without PEFT or bitsandbytes' config.
    final = out / "final"
    config = json.loads((final / "config.json").read_text())
    assert "quantization_config" not in config
    exported = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert not any("lora" in n for n, _ in exported.named_parameters())
    assert "verified: loads with no missing" in result.stdout
    # Frozen, not quantised (embeddings, norms, output layer): bit for bit the base's. Quantised
    # projections: the dequantised base plus the trained adapter, so not the base's 16-bit weights.
    start = dict(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).named_parameters())
    weights = dict(exported.named_parameters())
    untouched = [n for n in weights if not any(t in n for t in TARGETS)]
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(untouched)
    assert all(torch.equal(weights[n], start[n]) for n in untouched)
    assert all(not torch.equal(weights[n], start[n]) for n in weights if "q_proj" in n)

    # kill -9 mid-run, `--resume auto`: the same losses and the same exported weights, bit for bit.
    resume_after_kill_9(killed, _args(killed, base, *extra), step=3)
    assert losses(killed) == losses(out)  # exact float equality, every step logged once
    mine = dict(
        AutoModelForCausalLM.from_pretrained(killed / "final", dtype=torch.float32).named_parameters()
    )
    assert mine.keys() == weights.keys() and all(torch.equal(mine[n], weights[n]) for n in mine)

    # `llm-train export` of a checkpoint (adapters and optimizer only) gives the adapter, for PEFT.
    from llm_train.cli import main as cli_main

    assert cli_main(["export", str(out), str(tmp_path / "from-checkpoint")]) == 0
    adapter = tmp_path / "from-checkpoint"
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8


def test_qlora_zero2_adapter_reloads_and_resumes_exactly_after_kill_9(base: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    from llm_train.runtime.checkpointing.logit_reference import read_reference

    extra = ("lora.export=adapter", "checkpoint.every_steps=2", "--resume", "auto")
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    assert_ok(launch(_args(reference, base, *extra)))
    resume_after_kill_9(killed, _args(killed, base, *extra), step=3)
    assert losses(killed) == losses(reference)  # exact float equality, every step logged once
    mine, theirs = (load_file(d / "final" / "adapter_model.safetensors") for d in (killed, reference))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)

    # The adapter alone, on the user's base quantised the same way, gives the run's own logits.
    final = reference / "final"
    assert all("lora_A" in k or "lora_B" in k for k in mine)
    model = PeftModel.from_pretrained(_quantized_base(base), final).eval()
    ref = read_reference(final)
    assert ref is not None
    with torch.no_grad():
        logits = model(input_ids=ref.input_ids).logits.float()
    # The same CPU kernels in the same dtype as the run's own forward: only summation order may differ.
    assert (logits - ref.logits).abs().max() <= 1e-4 * ref.logits.abs().max()
