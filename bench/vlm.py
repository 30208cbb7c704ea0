"""The image-text case of the GPU run: LoRA on an 8B-class image-text model, images and text, under a 24 GiB cap.

    vlm_lora_24   8b-vlm-lora-rtx4090 (LoRA on one 24 GB card, vision tower frozen) on a random LLaVA-1.5-7B
                  shaped checkpoint (a 336-pixel CLIP ViT-L/14 tower, a 2-layer projector, Llama-2-7B's layers):
                  the bundled drawings and captions as image rows of 576 image tokens each, stopped after its
                  steps. Recorded: tokens/s with the image tokens (they are the rows' tokens), the image tokens
                  per row against the planner's, the GPU peaks against the planner's, the host peak.

Why LLaVA and not the recipe's Qwen2.5-VL: the GPU machine reaches no hub and has no torchvision, which
transformers 5.25's Qwen-VL processor imports (its video processor); LLaVA's CLIP processor is PIL only, and
the bundled one (llm_train/assets/tiny_vlm/processor, built by llm_train/assets/vlm.py) needs only its image
size raised to LLaVA-1.5's 336. The model's vocabulary is the bundled tokenizer's (4097 with `<image>`), not
Llama's 32000: the planner sizes the same checkpoint, so the comparison is like for like. Under --cpu-tiny the
base is tiny-cpu-vlm's model and its 56-pixel processor (16 image tokens), fp32: the logic runs, the planner's
numbers are recorded, not judged (bench/consumer.py's rules).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

from bench.cases import Case, Context
from bench.consumer import Consumer, base_dir, consumer_case
from bench.environment import REPO, module_cmd
from bench.launch import launch
from bench.verdicts import judge, verdict
from llm_train.units import GiB

RECIPE = "8b-vlm-lora-rtx4090"
BASE = "vlm_checkpoint"  # not the case's name: run_cases removes that folder after it
TINY_VLM = REPO / "llm_train" / "assets" / "tiny_vlm"
PROCESSOR = TINY_VLM / "processor"
CAPTIONS = TINY_VLM / "captions.jsonl"
IMAGE_SIZE_GPU = 336  # LLaVA-1.5's CLIP ViT-L/14-336: (336 / 14)^2 = 576 image tokens
# LLaVA-1.5-7B's shape (llava-hf/llava-1.5-7b-hf's config.json) but the bundled tokenizer's vocabulary.
VISION_GPU = {
    "model_type": "clip_vision_model",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": IMAGE_SIZE_GPU,
    "patch_size": 14,
    "projection_dim": 768,
}
TEXT_GPU = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
}
# The rows: every drawing with its caption; one image (576 or 16 tokens) and about 30 text tokens each.
OVERRIDES = (
    f"data.train=[{{path: '{CAPTIONS}', format: image_chat}}]",
    "data.packing=padded",
    "data.seq_len=640",
    "optim.micro_batch_size=2",
)
CPU_OVERRIDES = ("data.seq_len=64",)  # 16 image tokens and the caption


def base_config(gpu: bool) -> dict[str, Any]:
    """The checkpoint's config.json fields: LLaVA-1.5-7B's shape on the GPU, tiny-cpu-vlm's on CPU."""
    from llm_train.config.recipe import load_recipe

    tiny = dict(load_recipe("tiny-cpu-vlm").model.config)
    if not gpu:
        return tiny
    text = {**TEXT_GPU, "vocab_size": tiny["text_config"]["vocab_size"], "tie_word_embeddings": False}
    return {**tiny, "vision_config": VISION_GPU, "text_config": text, "vision_feature_layer": -2}


def make_base(out: Path, gpu: bool) -> None:
    """A random LLaVA saved as the hub's checkpoints are (5 GB shards), with its processor (its own process)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    fields = base_config(gpu)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device("cuda" if gpu else "cpu"):  # drawn on the GPU: seconds, not minutes
        model = AutoModelForImageTextToText.from_config(
            config, dtype=torch.bfloat16 if gpu else torch.float32
        )
    model.save_pretrained(out, max_shard_size="5GB")
    for item in PROCESSOR.iterdir():
        shutil.copy2(item, out / item.name)
    if gpu:  # the bundled processor resizes to 56 pixels; LLaVA-1.5's to 336
        path = out / "processor_config.json"
        processor = json.loads(path.read_text())
        image = processor["image_processor"]
        image["size"] = {"shortest_edge": IMAGE_SIZE_GPU}
        image["crop_size"] = {"height": IMAGE_SIZE_GPU, "width": IMAGE_SIZE_GPU}
        path.write_text(json.dumps(processor, indent=2) + "\n")


def base_case(ctx: Context) -> dict[str, Any]:
    out = ctx.work / BASE
    cmd = module_cmd("bench.vlm", "--make-base", str(out), *([] if ctx.gpu else ["--cpu-tiny"]))
    run = launch(cmd, ctx.timeout(), ctx.work / "vlm_base.log")
    ctx.results.log_launch("vlm_base", run)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / GiB if out.is_dir() else 0.0
    record: dict[str, Any] = {"shape": "llava-1.5-7b" if ctx.gpu else "tiny-cpu-vlm", "base_gib": size}
    record.update(wall_s=run.wall_s, passed=run.rc == 0 and size > 0)
    if not record["passed"]:
        record.update(error=f"{run.ended} writing the base", tail=run.tail)
    return record


def image_tokens(base: Path) -> int | None:
    """The image tokens the base's own processor puts into a row for one bundled drawing (None: no base)."""
    from PIL import Image
    from transformers import AutoProcessor

    if not (base / "processor_config.json").is_file():
        return None
    processor = AutoProcessor.from_pretrained(base)
    image = Image.open(sorted((TINY_VLM / "images").glob("*.png"))[0]).convert("RGB")
    ids = processor(text=[f"{processor.image_token} what?"], images=[image], return_tensors="pt")["input_ids"]
    return int((ids == processor.tokenizer.convert_tokens_to_ids(processor.image_token)).sum())


def with_image_tokens(case: Case) -> Case:
    """The LoRA case, then its image tokens per row against the planner's, judged everywhere: the count is
    exact arithmetic on both sides, on any machine (tests/unit/test_vision_plan.py holds it for the processors)."""

    def run(ctx: Context) -> dict[str, Any]:
        record = case.run(ctx)
        if record.get("passed") is None:  # skipped: nothing ran
            return record
        measured = image_tokens(base_dir(ctx, BASE))
        record["image_tokens_per_image"] = measured
        # Exact: tolerance 0 (the planner's count is the processor's arithmetic, not an estimate).
        check = verdict(
            "image_tokens_per_image", measured, record.get("est_image_tokens_per_image"), tolerance=0.0
        )
        return judge(record, [check])

    return dataclasses.replace(case, run=run)


def cases() -> list[Case]:
    """The base (14 GB drawn on the GPU and written), then the LoRA case; both optional: A's time left."""
    lora = Consumer(
        "vlm_lora_24",
        RECIPE,
        OVERRIDES,
        finish=False,
        steps=3,
        on_cpu=CPU_OVERRIDES,
        optional=True,
        base=BASE,
        # the emulated RTX 4090 runs sdpa (bench/consumer.py ON_RTX_40); the base's processor is its own
        on_gpu=("memory.attention=sdpa",),
    )
    return [
        Case("vlm_base", base_case, cost_s=45, box_s=75, optional=True),
        with_image_tokens(consumer_case(lora)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make-base", type=Path, required=True)
    parser.add_argument("--cpu-tiny", action="store_true")
    args = parser.parse_args()
    make_base(args.make_base, gpu=not args.cpu_tiny)


if __name__ == "__main__":
    main()
