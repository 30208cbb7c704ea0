"""Does a packed row see only its own documents? Per-document logits packed vs alone, per attention kernel.

    python -m bench.doc_isolation --model-dir D --rows R.pt --kernels sdpa sdpa_flex [--precision bf16] [--cpu]

The speed matrix's document-aware kernels are only a gain if they are exact, and a loss comparison
cannot tell: with random weights every loss sits near ln(vocabulary) whatever the mask does. This
compares logits instead, on the rows llm_train's data layer really deals (bundled text, packed, position
ids restarting per document, saved by bench/mfu_matrix.py): for each kernel, the row's logits in one
forward against each document's logits computed alone (its own row, positions from 0). Equal up to the
rounding of two computations (runtime/export/verify.py `logit_tolerance`: 4 ulps of the dtype times the
largest logit) means no document saw another.

The check must be able to fail, so each kernel also gets a planted leak: the same row with an all-ones
attention mask, which makes transformers drop the document boundaries (masking_utils: packed rows are
read from the position ids only without a mask), the positions kept. Measured on CPU (a 4-layer
1024-wide Llama, random init, bundled text): isolation 2e-6 of the logit scale in fp32 and 0.9% in bf16,
the planted leak 130% in both; the tolerance, 3% in bf16, sits between. A kernel passes when its
packed logits are within the tolerance and its planted leak is beyond it.

Prints `ISOLATION {json}` as its last line: per kernel the errors (relative to the logit scale), the
tolerance, the number of documents, `isolated`, `leak_seen`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch


def segments(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each document in a packed row: where the positions restart at 0."""
    starts = [int(i) for i in torch.nonzero(position_ids == 0).flatten()]
    return list(zip(starts, [*starts[1:], int(position_ids.numel())], strict=True))


def compare(
    model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> dict[str, Any]:
    from llm_train.runtime.export.verify import logit_tolerance

    spans = segments(positions)

    def logits(ids: torch.Tensor, pos: torch.Tensor, **mask: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids[None], position_ids=pos[None], **mask).logits[0].float()

    with torch.no_grad():
        packed = logits(input_ids, positions)
        alone = torch.cat(
            [logits(input_ids[a:b], torch.arange(b - a, device=input_ids.device)) for a, b in spans]
        )
        leaked = logits(input_ids, positions, attention_mask=torch.ones_like(input_ids)[None])
    scale = float(alone.abs().max())
    tolerance = logit_tolerance(alone, dtype)
    isolation, leak = float((packed - alone).abs().max()), float((leaked - alone).abs().max())
    return {
        "documents": len(spans),
        "tokens": int(input_ids.numel()),
        "isolation_error": isolation / scale,
        "planted_leak_error": leak / scale,
        "tolerance": tolerance / scale,
        "isolated": isolation <= tolerance,
        "leak_seen": leak > tolerance,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="Folder with the model's config.json.")
    parser.add_argument(
        "--rows", type=Path, required=True, help="torch.save'd dict of [rows, seq_len] tensors."
    )
    parser.add_argument("--kernels", nargs="+", required=True)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    from llm_train.runtime.model.document_attention import register_sdpa_flex

    register_sdpa_flex()
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    rows = torch.load(args.rows)
    # The row with the most documents: the most boundaries to leak across.
    starts = (rows["position_ids"] == 0).sum(dim=1)
    best = int(starts.argmax())
    input_ids, positions = rows["input_ids"][best].to(device), rows["position_ids"][best].to(device)
    config = AutoConfig.from_pretrained(args.model_dir)
    config.use_cache = False
    out: dict[str, Any] = {"device": device, "precision": args.precision, "row": best}
    for kernel in args.kernels:
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=kernel).eval()
        try:
            out[kernel] = compare(model, input_ids, positions, dtype)
        except Exception as exc:  # a kernel that cannot run here is reported, the others still run
            out[kernel] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        del model
    print("ISOLATION " + json.dumps(out), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
