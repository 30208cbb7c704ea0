"""The baseline of bench/overhead.py: a hand-written minimal Accelerate + DeepSpeed training loop.

What a user would write without llm_train: an Accelerator with a DeepSpeed plugin, a model
built after it (so ZeRO-3 builds it inside zero.Init, as llm_train does), AdamW, and the
four-line loop. Same tiny-cpu model, same packed corpus, same DS config (the one llm_train
resolves), same batch; it prints the loss every `--log-every` steps like a user's loop
would, and records the wall time of every iteration after the warm-up.

    accelerate launch --num_processes 2 --use_deepspeed bench/minimal_loop.py \
        --ds-config RUN/config/ds_config.json --steps 60 --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import InitProcessGroupKwargs
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "llm_train" / "assets" / "tiny"


def packed_blocks(seq_len: int) -> torch.Tensor:
    tok = Tokenizer.from_file(str(TINY / "tokenizer" / "tokenizer.json"))
    eos = 2
    ids: list[int] = []
    for doc in (TINY / "corpus.txt").read_text().split("\n\n"):
        if doc.strip():
            ids += tok.encode(doc, add_special_tokens=False).ids + [eos]
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def setup(ds_config_path: str) -> tuple[dict, dict, Accelerator, torch.nn.Module]:
    """tiny-cpu's recipe, the resolved DS config, an Accelerator on it, and the seeded tiny model."""
    recipe = yaml.safe_load((REPO / "recipes" / "tiny-cpu.yaml").read_text())
    ds_config = json.loads(Path(ds_config_path).read_text())
    handlers = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config), kwargs_handlers=handlers
    )
    fields = dict(recipe["model"]["config"])
    torch.manual_seed(recipe["optim"]["seed"])
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(fields.pop("model_type"), **fields), attn_implementation="sdpa"
    )
    return recipe, ds_config, accelerator, model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ds-config", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    recipe, ds_config, accelerator, model = setup(args.ds_config)
    optim = recipe["optim"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim["lr"], weight_decay=optim["weight_decay"])
    model, optimizer = accelerator.prepare(model, optimizer)

    micro = ds_config["train_micro_batch_size_per_gpu"]
    blocks = packed_blocks(recipe["data"]["seq_len"])
    blocks = blocks[accelerator.process_index :: accelerator.num_processes]  # shard by rank
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(0))

    model.train()
    marks: list[float] = []
    for step in range(1, args.steps + 1):
        start = (step * micro) % (len(order) - micro)
        batch = blocks[order[start : start + micro]].to(accelerator.device)
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)  # DeepSpeed: backward + step at the accumulation boundary
        optimizer.step()
        optimizer.zero_grad()
        if step % args.log_every == 0:
            accelerator.print(f"step {step} loss {loss.item():.4f}")
        marks.append(time.perf_counter())  # end of step `step`, after its logging, as llm_train's elapsed_s
    iterations = [b - a for a, b in zip(marks[args.warmup - 1 : -1], marks[args.warmup :], strict=True)]
    if accelerator.is_main_process:
        Path(args.out).write_text(
            json.dumps({"iteration_s": iterations, "world_size": accelerator.num_processes})
        )
    finish(accelerator)


def finish(accelerator: Accelerator) -> None:
    accelerator.end_training()  # also destroys the process group (AcceleratorState.destroy_process_group)


def run_and_exit(main: Callable[[], None]) -> None:
    main()
    sys.stdout.flush()
    # As in llm_train/train.py: skip interpreter teardown, where gloo/shm threads sometimes
    # abort ("terminate called without an active exception") after all results are written.
    os._exit(0)


if __name__ == "__main__":
    run_and_exit(main)
