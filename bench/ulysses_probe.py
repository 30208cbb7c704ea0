"""Probe: does DeepSpeed's Ulysses sequence parallelism run through Accelerate on CPU/gloo here?

Issue #15 wants `sp` as a layout degree wired through `accelerate.ParallelismConfig`. Before any
product code depends on it, this script checks the installed stack end to end, outside llm_train:
a tiny Llama (the bundled tokenizer's vocabulary, sdpa attention, fp32, ZeRO-2 or 3) trains a
few steps with sp=2 on 2 processes, and the same samples in the same order train with sp=1 on
one process. Per-micro-batch losses and per-step gradient norms are printed side by side.

How the sp=2 run consumes data (DeepSpeed's UlyssesSPDataLoaderAdapter): each SP rank loads its
own batch; the adapter all-gathers them, and on iteration i every rank gets its slice of the
sequence of batch i mod sp. So with accelerate's per-process sharding (rank r loads samples
r, r+2, ...) the SP group sees samples 0, 1, 2, ... in order, one per micro-batch, and the
sp=1 reference reads them in the same order with the same micro-batch and accumulation.

Half of the samples have their first 24 labels masked (-100), so the two SP ranks hold
different numbers of loss tokens: only a token-weighted mean over the SP group matches sp=1.

The SP loss is reduced either as transformers' `deepspeed_sp_compute_loss` does (`--reduction
gather`: differentiable all_gather of every rank's mean and token count) or as each rank's own
share, sum of its token losses / the group's tokens (`--reduction local`). Which one gives the
sp=1 gradient depends on how DeepSpeed reduces gradients over the SP ranks, which differs between
ZeRO-2 and ZeRO-3's reduce-scatter path: see bench/results/ulysses-probe-20261130.txt.

    .venv/bin/python bench/ulysses_probe.py [--zero 2|3] [--reduction local|gather] [--optim sgd]
        [--clip 0] [--no-reduce-scatter] [--steps 3]     # ~1 min on 2 cores; writes bench/results/
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from llm_train.runtime.launcher import free_port

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "llm_train" / "assets" / "tiny" / "tokenizer"
CORPUS = REPO / "llm_train" / "assets" / "tiny" / "corpus.txt"
SEQ_LEN, MICRO_BATCH, GRAD_ACCUM, LR, SGD_LR = 64, 1, 2, 1e-3, 0.5
MASKED_PREFIX = 24  # labels hidden on odd samples, like an SFT prompt


def samples(count: int) -> list[dict]:
    """`count` consecutive SEQ_LEN-token windows of the bundled corpus, with global position ids."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    ids = tokenizer(CORPUS.read_text()[:200_000])["input_ids"]
    out = []
    for i in range(count):
        window = torch.tensor(ids[i * SEQ_LEN : (i + 1) * SEQ_LEN])
        labels = window.clone()
        if i % 2:
            labels[:MASKED_PREFIX] = -100
        out.append({"input_ids": window, "labels": labels, "position_ids": torch.arange(SEQ_LEN)})
    return out


def worker(
    sp: int, zero: int, steps: int, reduction: str, clip: float, optim: str, reduce_scatter: bool
) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs, ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from llm_train.runtime import collectives

    ds_config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GRAD_ACCUM,
        # Explicit: DeepSpeed 0.19.8 clips at 1.0 when it is absent (GRADIENT_CLIPPING_DEFAULT in
        # deepspeed/runtime/constants.py). Off by default here,
        # because clipping (and Adam) hide a gradient that is off by a constant factor from the losses.
        "gradient_clipping": clip,
        "zero_optimization": {"stage": zero, "reduce_scatter": reduce_scatter},
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }
    parallelism = None
    if sp > 1:
        parallelism = ParallelismConfig(
            sp_backend="deepspeed",
            sp_size=sp,
            sp_handler=DeepSpeedSequenceParallelConfig(
                sp_seq_length=SEQ_LEN, sp_seq_length_is_variable=False, sp_attn_implementation="sdpa"
            ),
        )
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config),
        parallelism_config=parallelism,
        # Without the backend Accelerate miscounts on CPU + DeepSpeed: every rank reported
        # num_processes 1 and process_index 0 while DeepSpeed ran a world of 2 (checked, 2 processes).
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
    )
    rank = accelerator.process_index
    vocab = len(AutoTokenizer.from_pretrained(str(TOKENIZER)))
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    if optim == "sgd":  # plain SGD: a gradient off by a constant factor shows in the losses (Adam hides it)
        optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

    data = samples(steps * GRAD_ACCUM)  # accelerate deals them over the processes; the adapter pools them
    loader = torch.utils.data.DataLoader(
        data, batch_size=MICRO_BATCH, shuffle=False, collate_fn=lambda rows: _collate(rows, torch)
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    print(
        f"[rank {rank}] world={collectives.world_size()} accelerate num_processes={accelerator.num_processes} "
        f"loader={type(loader).__name__} len={len(loader)} train_batch_size={model.train_batch_size()} "
        f"dp_world={model.dp_world_size if hasattr(model, 'dp_world_size') else '?'}",
        flush=True,
    )
    if sp > 1:
        from deepspeed.utils import groups

        # Tensors go to the group's device (NCCL takes only CUDA tensors): every collective through
        # llm_train's module.
        sp_comm = collectives.Collectives(groups._get_sequence_parallel_group())
    unwrapped = accelerator.unwrap_model(model)

    records = []
    for micro, batch in enumerate(loader):
        if micro >= steps * GRAD_ACCUM:
            break
        batch = {k: (v.to(accelerator.device) if torch.is_tensor(v) else v) for k, v in batch.items()}
        if sp > 1:
            shift_labels = batch.pop("shift_labels")
            outputs = model(**batch)
            local = unwrapped.loss_function(
                logits=outputs.logits, labels=None, shift_labels=shift_labels, vocab_size=config.vocab_size
            )
            tokens = (shift_labels != -100).sum()
            if reduction == "gather":
                # Accelerate's test script and transformers' deepspeed_sp_compute_loss: a differentiable
                # all_gather of every rank's mean and token count, token-weighted mean on every rank.
                losses = torch.stack(sp_comm.gather_with_grad(local))
                counts = torch.stack(sp_comm.gather_with_grad(tokens))
                losses = torch.where(counts > 0, losses, torch.zeros_like(losses))
                loss = (losses * counts).sum() / counts.sum().clamp(min=1)
                reported = loss
            else:
                # Each rank backpropagates only its own share, sum(token losses) / group tokens:
                # DeepSpeed sums gradients over the SP ranks (it divides by dp, not by dp * sp).
                total = sp_comm.sum(tokens.detach())
                share = torch.where(tokens > 0, local * tokens, torch.zeros_like(local))
                loss = share / total.clamp(min=1)
                reported = sp_comm.sum(loss.detach())
            shard = f"{tuple(batch['input_ids'].shape)} tokens={int(tokens)}"
        else:
            outputs = model(**batch)
            loss = reported = outputs.loss
            shard = f"{tuple(batch['input_ids'].shape)}"
        model.backward(loss)
        boundary = model.is_gradient_accumulation_boundary()
        model.step()
        record = {"micro": micro, "loss": float(reported), "shard": shard}
        if boundary:
            record["grad_norm"] = float(model.get_global_grad_norm())
        records.append(record)
    if rank == 0:
        print("RESULT " + json.dumps(records), flush=True)
    accelerator.end_training()


def _collate(rows: list[dict], torch) -> dict:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def launch(sp: int, nproc: int, args: argparse.Namespace) -> tuple[int, str, float]:
    cmd = [
        str(Path(sys.executable).with_name("accelerate")),
        "launch",
        "--num_processes",
        str(nproc),
        "--use_deepspeed",
        "--main_process_port",
        str(free_port()),
        __file__,
        "--worker",
        "--sp",
        str(sp),
        "--zero",
        str(args.zero),
        "--steps",
        str(args.steps),
        "--reduction",
        args.reduction,
        "--clip",
        str(args.clip),
        "--optim",
        args.optim,
        *([] if args.reduce_scatter else ["--no-reduce-scatter"]),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    return proc.returncode, proc.stdout + proc.stderr, time.time() - start


def _result(output: str) -> list[dict] | None:
    for line in output.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help="internal: one process of a launch")
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--zero", type=int, default=2, choices=[2, 3])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reduction", choices=["gather", "local"], default="local")
    parser.add_argument("--clip", type=float, default=0.0, help="gradient_clipping; 0 = off")
    parser.add_argument("--optim", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument(
        "--no-reduce-scatter",
        dest="reduce_scatter",
        action="store_false",
        help="zero_optimization.reduce_scatter=false (ZeRO-3 then reduces through another code path)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.worker:
        try:
            worker(args.sp, args.zero, args.steps, args.reduction, args.clip, args.optim, args.reduce_scatter)
        except Exception:
            traceback.print_exc()
            sys.exit(1)
        return

    import accelerate
    import deepspeed
    import torch
    import transformers

    lines = [
        f"# bench/ulysses_probe.py, {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        f"# torch {torch.__version__}, deepspeed {deepspeed.__version__}, accelerate {accelerate.__version__}, "
        f"transformers {transformers.__version__}; CPU, gloo",
        f"# tiny Llama (2 layers, 4 heads, 2 KV heads, hidden 64), sdpa, fp32, ZeRO-{args.zero}, seq_len {SEQ_LEN}, "
        f"micro-batch {MICRO_BATCH}, accumulation {GRAD_ACCUM}, {args.steps} steps, {args.optim} lr {SGD_LR if args.optim == 'sgd' else LR}, "
        f"gradient_clipping {args.clip}, reduce_scatter {args.reduce_scatter}, "
        f"SP loss reduction: {args.reduction}",
    ]
    runs = {}
    for name, sp, nproc in (
        ("sp=1 (1 process)", 1, 1),
        (f"sp={args.sp} ({args.sp} processes)", args.sp, args.sp),
    ):
        rc, output, seconds = launch(sp, nproc, args)
        runs[name] = _result(output)
        lines.append(f"\n## {name}: exit {rc}, {seconds:.0f} s")
        lines += [line for line in output.splitlines() if line.startswith("[rank")]
        if rc != 0 or runs[name] is None:
            lines.append("### output tail")
            lines += output.splitlines()[-60:]
    ref, sp_run = runs.values()
    if ref and sp_run:
        lines.append("\n## per micro-batch: loss sp=1, loss sp, |diff|; grad norm at step ends")
        worst_loss = worst_norm = 0.0
        for a, b in zip(ref, sp_run, strict=False):
            diff = abs(a["loss"] - b["loss"])
            worst_loss = max(worst_loss, diff)
            row = f"micro {a['micro']}: {a['loss']:.6f} {b['loss']:.6f} {diff:.2e}  [{b['shard']}]"
            if "grad_norm" in a and "grad_norm" in b:
                norm_diff = abs(a["grad_norm"] - b["grad_norm"])
                worst_norm = max(worst_norm, norm_diff)
                row += f"  grad_norm {a['grad_norm']:.6f} {b['grad_norm']:.6f} {norm_diff:.2e}"
            lines.append(row)
        lines.append(f"max |loss diff| {worst_loss:.2e}, max |grad norm diff| {worst_norm:.2e}")
    text = "\n".join(lines) + "\n"
    print(text)
    out = (
        args.out
        or REPO
        / "bench"
        / "results"
        / f"ulysses-probe-zero{args.zero}-{args.reduction}-{args.optim}-rs{int(args.reduce_scatter)}-{dt.date.today():%Y%m%d}.txt"
    )
    out.write_text(text)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
