"""GRPO's second generation engine: transformers' continuous batching (`generate_batch`, paged attention).

`HfGeneration` (grpo.py) runs `generate` on left-padded rows: every row decodes until the longest is done,
and a short prompt pays for the longest one's padding. Continuous batching schedules requests (one per
completion) over a paged key-value cache: a finished completion frees its blocks and its slot at once, and
the prefill packs prompts of uneven length without padding. TRL 1.16 offers it as
`use_transformers_continuous_batching` (grpo_trainer.py `_generate_single_turn`: `generate_batch(prompt_ids,
generation_config=..., continuous_batching_config=..., progress_bar=False)`, completions read from each
output's `generated_tokens`); chosen here by the recipe key of the same name.

Facts it relies on (transformers 5.25, checked on CPU 2026-12-06):
- `generate_batch` runs on CPU with the model's sdpa attention (it switches to its paged variant itself) and
  returns a dict of outputs in the order of the inputs (continuous_api.py re-orders by request id).
- The cache is sized from the accelerator's free memory unless `num_blocks` / `max_batch_tokens` are given;
  on a CPU that "free memory" is the host's, so they are given here from the step's own rows: every
  prompt's blocks plus its completion's at grpo.max_completion_length (an upper bound; blocks shared between
  the num_generations copies of one prompt only leave some unused).
- Sampling draws from the continuous batching manager's own generator, seeded by its config's `seed`: drawn
  here from torch's RNG, so a seeded run stays seeded and each rank and step samples differently.
- Its logits processors are temperature, top-k and top-p (and others whose support is unknown, kept);
  transformers marks repetition_penalty unsupported and would drop it silently: the recipe refuses the
  combination (and generation_kwargs with it) instead.
- Greedy decoding gives the same tokens as `generate` (tests/unit/test_grpo_continuous.py).

LoRA: the PEFT model's adapters stay unmerged; the paged forward runs through the same LoRA layers. Merging
them for generation and unmerging after would round every weight it touches (W + BA - BA is not W in
floating point), so it is not done; exact would take a copy of every adapted weight. TRL 1.16 does the same on
this path (grpo_trainer.py calls `generate_batch` on the unwrapped PEFT model; it merges and unmerges only to
send weights to vLLM, where it accepts the rounding).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from llm_train.config.objective_sections import GrpoSection
from llm_train.runtime.base.compat import gathered_for_generation
from llm_train.runtime.rl.grpo import sampling_options

PAGE_SIZE = 32  # tokens per cache block and layer: small blocks waste little on a short completion


def cut_rows_at_eos(rows: list[list[int]], eos_ids: list[int]) -> list[list[int]]:
    """Each completion up to and including its first stop token (as `cut_at_eos` for generate's rows)."""
    out = []
    for row in rows:
        end = next((i for i, t in enumerate(row) if t in eos_ids), None)
        out.append(list(row) if end is None else list(row[: end + 1]))
    return out


def cache_blocks(prompts: list[list[int]], new_tokens: int, page_size: int = PAGE_SIZE) -> int:
    """Blocks the step's requests can hold at once: each prompt and its longest completion, rounded up."""
    return sum(math.ceil((len(p) + new_tokens) / page_size) for p in prompts)


class ContinuousBatchingGeneration:
    """transformers' `generate_batch` on the engine's module: sampling, eval mode, no grad; under ZeRO-3 the
    whole model gathered while it writes, as `HfGeneration` does (grpo.ds3_gather_for_generation)."""

    def __init__(self, engine: Any, zero3: bool, grpo: GrpoSection, pad_id: int, eos_ids: list[int]) -> None:
        self.engine, self.module, self.zero3, self.grpo = engine, engine.module, zero3, grpo
        self.pad_id, self.eos_ids = pad_id, eos_ids

    def _whole_model(self) -> contextlib.AbstractContextManager[None]:
        whole = self.zero3 and self.grpo.ds3_gather_for_generation
        return gathered_for_generation(self.engine) if whole else contextlib.nullcontext()

    def configs(self, prompts: list[list[int]]) -> tuple[Any, Any]:
        """(the GenerationConfig both engines use, the ContinuousBatchingConfig sized for these prompts)."""
        from transformers import ContinuousBatchingConfig, GenerationConfig

        options = sampling_options(self.grpo, self.pad_id, self.eos_ids)  # top_k 0: no filter in both engines
        cuda = next(self.module.parameters()).device.type == "cuda"
        batching = ContinuousBatchingConfig(
            page_size=PAGE_SIZE,
            num_blocks=cache_blocks(prompts, self.grpo.max_completion_length) + len(prompts),
            max_batch_tokens=max(sum(len(p) for p in prompts), PAGE_SIZE),
            seed=int(torch.randint(0, 2**31 - 1, (1,))),
            drop_unsupported_processors=False,  # refused at parse instead (module docstring)
            use_cuda_graph=None if cuda else False,
        )
        return GenerationConfig(**options), batching

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        generation, batching = self.configs(prompts)
        was_training = self.module.training
        self.module.eval()
        try:
            with self._whole_model():
                outputs = self.module.generate_batch(
                    inputs=prompts,
                    generation_config=generation,
                    continuous_batching_config=batching,
                    progress_bar=False,
                    warmup=False,  # the warm-up captures CUDA graphs, for one call per step it costs more
                )
        finally:
            if was_training:
                self.module.train()
        rows = [list(o.generated_tokens) for o in outputs.values()]
        if len(rows) != len(prompts):
            raise RuntimeError(
                f"continuous batching returned {len(rows)} completions for {len(prompts)} prompts"
            )
        return cut_rows_at_eos(rows, self.eos_ids)
