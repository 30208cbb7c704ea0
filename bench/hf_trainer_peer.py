"""The peer a user would pick instead of llm_train: the Hugging Face Trainer on the same job, one process.

bench/mfu_matrix.py runs it as one of its variants. Same job means: the same model config and the
same initial weights (torch.manual_seed(seed), then `AutoModelForCausalLM.from_config` on the device
it trains on, as llm_train's runtime/model/model.py builds a random model), the same micro-batches in the same order
(the rows llm_train's data layer deals to rank 0, written by `save_job`: packed rows keep their
restarting position ids, as Trainer users pass them with DataCollatorWithFlattening), the same
DeepSpeed JSON (the shipped ds_configs file, whose "auto" values the Trainer fills itself), the same
optimizer settings (AdamW, lr, betas, eps, weight decay, gradient clipping, a constant LR) and
precision (bf16; fp32 for the matrix's --cpu-tiny).
The attention is the Trainer's default, sdpa; `use_cache` is off, as for any training run (with a
cache, transformers would not read the position ids as sample boundaries).

Writes OUT/metrics.jsonl: one row per optimizer step with the step, loss (the Trainer logs it
rounded to 4 decimals), step time (between consecutive step ends, after a device synchronisation,
as llm_train's loop measures it), tokens/s and the allocator's peak.

    python -m bench.hf_trainer_peer --model-dir D --rows R.pt --ds-config ds_configs/zero2.json --out O ...

For a resolved llm_train run, `save_job` writes those inputs and `command` is the launch on them with the
run's settings: bench/mfu_matrix.py uses them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench.environment import module_cmd
from llm_train.units import GiB


def flags(values: dict[str, object]) -> list[str]:
    """`--name value` for each item."""
    return [arg for name, value in values.items() for arg in (f"--{name}", str(value))]


def save_job(run: Any, folder: Path, steps: int) -> None:
    """FOLDER/model (the run's model config) and FOLDER/rows.pt: the first `steps` micro-batches the run's
    data layer deals rank 0, in its order, as one dict of [rows, seq_len] tensors."""
    import torch

    from llm_train.data import BatchStream, load_blocks
    from llm_train.runtime.model.model import load_tokenizer, model_config

    recipe, seed = run.recipe, run.recipe.optim.seed
    model_config(recipe.model).save_pretrained(folder / "model")
    train, _ = load_blocks(recipe.data, load_tokenizer(recipe.model), seed)
    stream = BatchStream(train, run.layout.micro_batch_size, 0, 1, seed, workers=0, pin_memory=False)
    batches = [next(stream) for _ in range(steps)]
    keys = [k for k, v in batches[0].items() if isinstance(v, torch.Tensor)]
    torch.save({k: torch.cat([b[k] for b in batches]) for k in keys}, folder / "rows.pt")


def command(run: Any, folder: Path, out: Path, steps: int, gpu: bool) -> list[str]:
    """The peer on save_job's FOLDER for `steps` steps, with the run's DS JSON, optimizer and precision."""
    optim = run.recipe.optim
    inputs = {"model-dir": folder / "model", "rows": folder / "rows.pt", "ds-config": run.ds_path, "out": out}
    job = {"micro-batch": run.layout.micro_batch_size, "steps": steps, "precision": run.layout.precision}
    adamw = {
        k.replace("_", "-"): getattr(optim, k) for k in ["lr", "eps", "weight_decay", "grad_clip", "seed"]
    }
    cpu = [] if gpu else ["--cpu"]
    return module_cmd(
        "bench.hf_trainer_peer", *flags({**inputs, **job, **adamw}), "--betas", *map(str, optim.betas), *cpu
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True, help="Folder with the model's config.json.")
    p.add_argument("--rows", type=Path, required=True, help="torch.save'd dict of [rows, seq_len] tensors.")
    p.add_argument("--ds-config", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    for name in ("lr", "eps", "weight-decay", "grad-clip"):
        p.add_argument(f"--{name}", type=float, required=True)
    p.add_argument("--betas", type=float, nargs=2, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--cpu", action="store_true", help="No GPU (the matrix's --cpu-tiny).")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import torch

    from llm_train.runtime.base.launch_env import set_single_process_env

    # A world of one on a free port, as `python llm_train/train.py` makes it (the Trainer's DeepSpeed needs a
    # process group; the matrix's previous launch may hold its port).
    set_single_process_env()
    # DeepSpeed's ops as llm_train's runs load them (the same ninja, one CPU probe): set-up only, untimed.
    from llm_train.runtime.base.compat import prepare_op_loads, skip_unused_shm_op

    prepare_op_loads()
    skip_unused_shm_op()  # nor the build of DeepSpeed's CPU shm op, which the Trainer's run never calls

    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    config = AutoConfig.from_pretrained(args.model_dir)
    config.use_cache = False
    cuda = torch.cuda.is_available() and not args.cpu
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    with torch.device("cuda" if cuda else "cpu"):  # where llm_train draws them: the same numbers
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    args.out.mkdir(parents=True, exist_ok=True)
    metrics = (args.out / "metrics.jsonl").open("w")
    tensors = torch.load(args.rows)
    rows = [{k: v[i] for k, v in tensors.items()} for i in range(len(tensors["input_ids"]))]
    tokens_per_step = args.micro_batch * int(tensors["input_ids"].shape[1])

    class Meter(TrainerCallback):
        """One metrics row per step: the interval between step ends, and the loss the Trainer logs for it."""

        def __init__(self) -> None:
            self.last = time.perf_counter()
            self.pending: dict[str, Any] | None = None

        def on_train_begin(self, _args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.last = time.perf_counter()  # the first step's time starts here, as llm_train's does

        def on_step_end(self, _args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            step_time, self.last = now - self.last, now
            self.pending = {
                "step": state.global_step,
                "step_time_s": step_time,
                "tokens_per_s": tokens_per_step / step_time,
            }
            if cuda:
                self.pending["gpu_mem_peak_gib"] = torch.cuda.max_memory_allocated() / GiB

        def on_log(
            self, _args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
        ) -> None:
            if self.pending is not None and logs and "loss" in logs:
                metrics.write(json.dumps({**self.pending, "loss": logs["loss"]}) + "\n")
                metrics.flush()
                self.pending = None

    training = TrainingArguments(
        output_dir=str(args.out / "trainer"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=1,
        max_steps=args.steps,
        learning_rate=args.lr,
        adam_beta1=args.betas[0],
        adam_beta2=args.betas[1],
        adam_epsilon=args.eps,
        weight_decay=args.weight_decay,
        max_grad_norm=args.grad_clip,
        lr_scheduler_type="constant",
        warmup_steps=0,
        bf16=args.precision == "bf16",
        deepspeed=str(args.ds_config),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        train_sampling_strategy="sequential",  # the matrix's rows are already in llm_train's order
        dataloader_num_workers=2 if cuda else 0,
        dataloader_pin_memory=cuda,
        use_cpu=not cuda,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training, train_dataset=rows, callbacks=[Meter()])
    trainer.train()
    metrics.close()


if __name__ == "__main__":
    main()
