"""`llm-train plan`: will this recipe fit my GPUs and host RAM, and if not, what is the cheapest fix?

llm-train plan --recipe 7b-rtx4090 --gpu-mem 24 --host-ram 192
llm-train plan --recipe 7b-rtx4090 --gpu-mem 24 --host-ram 64 --nvme-gib 900
llm-train plan --recipe 7b-zero3 --gpus 8 --gpu H100
llm-train plan --recipe auto --model meta-llama/Llama-3.1-8B --gpu RTX-4090 [--train]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from pathlib import Path

from llm_train import train as train_module
from llm_train.config.hardware import DriveSpeeds, hardware_for
from llm_train.errors import UserError
from llm_train.planning.auto.choose import choose_auto
from llm_train.planning.auto.written import auto_recipe_yaml, check_written, render_auto
from llm_train.planning.report.verdict import plan_recipe, render
from llm_train.train import main as train_main

# --- CLI ------------------------------------------------------------------------------------------------


def drive_speeds(read_gbs: float | None, write_gbs: float | None) -> DriveSpeeds:
    """Hardware fields for the drive speeds given on the command line (GB/s -> bytes/s)."""
    out: DriveSpeeds = {}
    if read_gbs is not None:
        out["nvme_read_bytes_per_s"] = read_gbs * 1e9
    if write_gbs is not None:
        out["nvme_write_bytes_per_s"] = write_gbs * 1e9
    return out


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="Will it fit? Memory estimate, verdict and the cheapest fixes (or --recipe auto).",
        description="Estimate per-GPU memory, host RAM and speed for a recipe on given hardware; "
        "say whether it fits and rank the cheapest changes that make it fit.",
    )
    p.add_argument("--recipe", required=True, help="A recipe name or YAML path, or 'auto' (with --model).")
    p.add_argument(
        "--model", help="With --recipe auto: a known model id or a local directory with config.json."
    )
    p.add_argument("--gpus", type=int, help="Number of GPUs (processes) in total (default: the recipe's).")
    p.add_argument(
        "--gpu", help="GPU model, e.g. RTX-4090, A100-80GB, H100 (default: detected or the recipe's)."
    )
    p.add_argument("--gpu-mem", type=float, metavar="GIB", help="Memory per GPU in GiB (overrides --gpu's).")
    p.add_argument(
        "--host-ram", type=float, metavar="GIB", help="Host RAM per node in GiB (default: this machine)."
    )
    p.add_argument(
        "--nvme-gib",
        type=float,
        metavar="GIB",
        help="Free NVMe space per node for ZeRO-Infinity offload; without it NVMe offload is never chosen.",
    )
    p.add_argument(
        "--nvme-read-gbs",
        type=float,
        metavar="GB/S",
        help="Sequential read speed of that drive in GB/s (default 6, a PCIe 4.0 drive; `llm-train doctor "
        "--recipe NAME` measures yours).",
    )
    p.add_argument(
        "--nvme-write-gbs",
        type=float,
        metavar="GB/S",
        help="Sustained sequential write speed of that drive in GB/s (default 3: past a TLC drive's SLC cache).",
    )
    p.add_argument(
        "--seq-len", type=int, help="With --recipe auto: tokens per sequence (default min(2048, model max))."
    )
    p.add_argument(
        "--global-batch", type=int, default=64, help="With --recipe auto: sequences per optimizer step."
    )
    lora = p.add_mutually_exclusive_group()
    lora.add_argument(
        "--lora", action="store_true", help="With --recipe auto: train LoRA adapters, not all weights."
    )
    lora.add_argument("--no-lora", action="store_true", help="With --recipe auto: never fall back to LoRA.")
    p.add_argument("--write", metavar="PATH", help="With --recipe auto: write the generated recipe here.")
    p.add_argument(
        "--train",
        action="store_true",
        help="With --recipe auto: write the recipe into --output-dir and train it.",
    )
    p.add_argument(
        "--output-dir", help="With --train: where the recipe and the run go (default runs/auto-MODEL)."
    )
    p.add_argument(
        "overrides", nargs="*", metavar="key.sub=value", help="Recipe overrides, e.g. data.seq_len=4096."
    )
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    # `not 0 < x < inf`: argparse's float() takes nan and inf, which `x <= 0` lets through.
    if args.nvme_gib is not None and not 0 < args.nvme_gib < math.inf:
        raise UserError(
            f"--nvme-gib {args.nvme_gib:g}: give the free NVMe space in GiB (> 0), or leave it out"
        )
    for flag in ("nvme_read_gbs", "nvme_write_gbs"):
        value = getattr(args, flag)
        if value is not None and not 0 < value < math.inf:
            raise UserError(f"--{flag.replace('_', '-')} {value:g}: give the drive's speed in GB/s (> 0)")
    speeds = drive_speeds(args.nvme_read_gbs, args.nvme_write_gbs)
    if args.recipe != "auto":
        for flag in ("model", "write", "output_dir", "seq_len"):
            if getattr(args, flag) is not None:  # --seq-len 0 too: given, so not silently ignored
                raise UserError(f"--{flag.replace('_', '-')} only applies to --recipe auto")
        if args.train:
            raise UserError(
                f"--train only applies to --recipe auto; train a recipe with: llm-train train --recipe {args.recipe}"
            )
        report = plan_recipe(
            args.recipe,
            args.overrides,
            args.gpus,
            args.gpu,
            args.gpu_mem,
            args.host_ram,
            nvme_gib=args.nvme_gib,
            drive=speeds,
        )
        print(render(report))
        return 0
    if not args.model:
        raise UserError("--recipe auto needs --model ID_OR_PATH (a known id or a directory with config.json)")
    hw = dataclasses.replace(hardware_for(args.gpus, args.gpu, args.gpu_mem, args.host_ram, None), **speeds)
    mode = "always" if args.lora else "never" if args.no_lora else "fallback"
    auto = choose_auto(
        args.model,
        hw,
        args.seq_len,
        args.global_batch,
        lora=mode,
        nvme_gib=args.nvme_gib,
        overrides=args.overrides,
    )
    out_dir = Path(
        args.output_dir or f"runs/auto-{re.sub(r'[^a-z0-9]+', '-', args.model.lower()).strip('-')[-40:]}"
    )
    path = Path(args.write) if args.write else (out_dir / "recipe.yaml" if args.train else None)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(auto_recipe_yaml(auto))  # the overrides are in it
        try:
            # The file itself, resolved as `llm-train plan --recipe FILE` resolves it, plans the choice printed
            # below (choose_auto checked the mapping before; this checks what reached the disk).
            check_written(auto, path)
        except UserError:
            path.unlink()
            raise
    print(render_auto(auto, path))
    if not args.train:
        return 0
    assert path is not None
    train_args = ["--recipe", str(path), "--output-dir", str(out_dir / "run")]  # it trains what was planned
    if hw.gpus > 1:
        import subprocess

        accelerate = Path(sys.executable).with_name("accelerate")
        train_py = Path(train_module.__file__)
        cmd = [str(accelerate), "launch", "--num_processes", str(hw.gpus), str(train_py), *train_args]
        print("launching: " + " ".join(cmd), flush=True)
        return subprocess.call(cmd)

    return train_main(train_args)
