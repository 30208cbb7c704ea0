"""GRPO's two generation engines on one tiny job: transformers' `generate` (HfGeneration) against continuous
batching (`generate_batch`, ContinuousBatchingGeneration; grpo.use_transformers_continuous_batching).

    .venv/bin/python -m bench.grpo_generation [--rounds 3] [--prompts 32] [--new-tokens 64]

The job: tiny-cpu-grpo's model shape (4 layers, hidden 128, vocabulary 4096; random weights, fp32, sdpa),
--prompts prompts of 8-40 tokens (uneven, seeded), --new-tokens tokens sampled at temperature 1 with no
top-k / top-p filter, one call per engine per round, each engine called exactly as the rollouts call it (all
rows in one call). Rounds alternate the engines, so load from other processes on a shared machine falls on
both alike; the result is each engine's median generated tokens/s over the rounds and their ratio, printed
and written to bench/results/grpo_generation-<date>.json. Tokens counted are those each returned (cut after
a first EOS), so an engine that stops early is not credited for tokens it did not write.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def _job(prompts: int, new_tokens: int) -> tuple[Any, Any, list[list[int]]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from llm_train.config.objective_sections import GrpoSection, parse_reward
    from llm_train.runtime.rl.continuous import ContinuousBatchingGeneration
    from llm_train.runtime.rl.grpo import HfGeneration

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    grpo = GrpoSection(
        max_completion_length=new_tokens, rewards=[parse_reward({"kind": "format", "pattern": "x"}, "r")]
    )
    engine = SimpleNamespace(module=model)
    g = torch.Generator().manual_seed(1)
    rows = [
        torch.randint(3, 4096, (int(n),), generator=g).tolist()
        for n in torch.randint(8, 41, (prompts,), generator=g)
    ]
    return (
        HfGeneration(engine, False, grpo, 0, [2]),
        ContinuousBatchingGeneration(engine, False, grpo, 0, [2]),
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    generate, batching, prompts = _job(args.prompts, args.new_tokens)
    rates: dict[str, list[float]] = {"generate": [], "continuous_batching": []}
    for r in range(args.rounds):
        order = [("generate", generate), ("continuous_batching", batching)]
        for name, engine in order if r % 2 == 0 else order[::-1]:
            torch.manual_seed(100 + r)
            start = time.perf_counter()
            completions = engine(prompts)
            seconds = time.perf_counter() - start
            tokens = sum(len(c) for c in completions)
            rates[name].append(tokens / seconds)
            print(
                f"round {r + 1} {name}: {tokens} tokens in {seconds:.1f}s = {tokens / seconds:.1f} tokens/s",
                flush=True,
            )
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratio = medians["continuous_batching"] / medians["generate"]
    print(
        f"median generation tokens/s: generate {medians['generate']:.1f}, continuous batching "
        f"{medians['continuous_batching']:.1f} ({ratio:.2f}x)"
    )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"grpo_generation-{time.strftime('%Y%m%d-%H%M')}.json"
    out.write_text(
        json.dumps(
            {
                "job": vars(args),
                "tokens_per_s": rates,
                "median_tokens_per_s": medians,
                "ratio": ratio,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "machine": platform.machine(),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
