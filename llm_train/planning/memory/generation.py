"""GRPO's generation, as the planner counts it: the memory of one `generate` call and its time.

What it describes is runtime/rl/grpo.py as it runs (the planner describes the runtime, never the target):

- **One call per rank and step.** `Rollouts._rollout` repeats each of this rank's prompts num_generations times
  and hands all of them to one transformers `generate` call: micro_batch_size x grad_accum completions (the
  rank's whole step), left-padded to its longest prompt. The estimate takes the longest prompt a row may have,
  data.seq_len - grpo.max_completion_length (data/prompts.py drops or refuses longer ones), and every completion
  at grpo.max_completion_length (no early EOS).
- **Key-value cache.** transformers' DynamicCache keeps, per decoder layer, a key and a value tensor of [rows x
  kv heads x tokens x head size] in the model's dtype: 2 x layers x kv heads x head size x rows x tokens values
  (`kv_cache_bytes`; tests/unit/test_generation_plan.py measures a tiny model's cache after `generate` and finds
  exactly this, with tokens = prompt + completion - 1: the last sampled token is never fed back).
- **Prefill.** The first forward runs every prompt token at once, without gradients: one layer's working set
  at a time, the largest being the MLP's (SiLU(gate), up and their product, 3 x intermediate values per token)
  beside the residual stream and attention's q, k, v and output (4 x hidden): `prefill_bytes`.
- **Sampling.** Each step keeps the last position's logits only (generate sets logits_to_keep=1): the model's
  logits in its dtype, their fp32 copy, the processed scores and the probabilities (transformers 5.25
  generation/utils.py `_sample`); top_p < 1 sorts them too (values, int64 indices, softmax and cumsum:
  generation/logits_process.py TopPLogitsWarper): `sampling_bytes`.
- **ZeRO-3.** compat.gathered_for_generation gathers every parameter at once (deepspeed.zero.GatheredParameters
  over the whole module, no groups): the whole model at its stored bytes on every rank, beside the shard each
  rank keeps, for the whole call. With grpo.ds3_gather_for_generation false, ZeRO-3's own hooks gather one
  layer at a time (one layer's parameters live, beside the prefetch bucket training already counts) for every
  forward of the call: the prefill and each decode step move the whole model over the interconnect.
- **Time** (a rough model until measured on a GPU): the prefill is a forward of rows x prompt tokens at the
  training efficiency; each decode step is bounded by the largest of reading every weight once (a 4-bit base is
  dequantised first: its packed bytes read, the 16-bit copy written and read) and the cache written so far at
  the card's memory bandwidth (DECODE_BANDWIDTH_EFFICIENCY), its matmuls' compute, and eager PyTorch's
  per-layer launch overhead (DECODE_SECONDS_PER_LAYER), which bounds a small batch on a fast card. Under
  ZeRO-3 the gather crosses the interconnect once per call. One generation serves grpo.num_iterations
  optimizer steps; with more than one, each micro-batch's log-probs under the generating policy are taken
  once, a forward (runtime/rl/grpo.py `_micro_batch`).

Pure arithmetic: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_train.planning.model.shapes import ModelShape

# Per value of the [rows x vocabulary] last-position logits: the model's logits (dtype bytes, added by the
# caller), their fp32 copy, the processed scores, the probabilities; with top_p < 1, the sorted values,
# their int64 indices, their softmax and its cumsum.
SAMPLING_BYTES_PER_LOGIT = 4 + 4 + 4
TOP_P_BYTES_PER_LOGIT = 4 + 8 + 4 + 4
# What a prefill layer holds per token beside the cache: the MLP's three [tokens x intermediate] tensors
# (SiLU(gate), up, their product) and four [tokens x hidden] ones (residual, normed input, attention output, q).
PREFILL_INTERMEDIATE_TENSORS = 3
PREFILL_HIDDEN_TENSORS = 4
# Decode streams weights and cache at this fraction of the card's memory bandwidth (elementwise and
# GEMV-shaped kernels; the same assumption as DEQUANTIZE_BANDWIDTH_EFFICIENCY) until a GPU run measures it.
DECODE_BANDWIDTH_EFFICIENCY = 0.7
# Eager PyTorch launches each decode step's kernels one by one from Python: PyTorch's "GPT, Fast" post
# measured Llama-2-7B on an A100 at 25.5 tokens/s eager, batch 1, and ~107 with the launches captured
# (torch.compile, static cache): ~30 ms of launch overhead per token over 32 layers, ~0.9 ms per layer.
# transformers' Llama layer launches at least as many kernels; an assumption until bench/gpu_run.sh times it.
DECODE_SECONDS_PER_LAYER = 0.9e-3


@dataclass(frozen=True)
class GenerationInputs:
    """What a GRPO run generates per rank and step, as far as memory and time are concerned (recipe.grpo)."""

    num_generations: int
    completion_tokens: int
    """grpo.max_completion_length: every completion is counted at it."""
    num_iterations: int = 1
    """grpo.num_iterations: optimizer steps per generation."""
    top_p: float = 1.0
    """grpo.top_p: below 1 the sampler sorts the logits."""
    gather_whole: bool = True
    """grpo.ds3_gather_for_generation (ZeRO-3): the whole model gathered once per call, else each layer gathered
    by ZeRO-3's hooks as each forward of the call (the prefill and every decode step) reaches it."""
    engine: str = "generate"
    """'generate' or 'continuous batching' (grpo.use_transformers_continuous_batching, runtime/rl/continuous.py).
    Counted alike: its paged cache is sized for every prompt and its whole completion (the same bound as the
    DynamicCache here, rounded up to 32-token pages), and its decode steps read the same weights; it saves the
    padding of uneven prompts and the steps after a completion ends, which this bound does not credit."""

    def prompt_tokens(self, seq_len: int) -> int:
        """The longest prompt a row may have (data/prompts.py drops or refuses longer ones)."""
        return max(1, seq_len - self.completion_tokens)

    def cache_tokens(self, seq_len: int) -> int:
        """Positions in the cache when the last token is sampled: prompt + completion - 1 (never fed back)."""
        return self.prompt_tokens(seq_len) + self.completion_tokens - 1


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """One token's keys and values over every layer: 2 x layers x kv heads x head size x dtype bytes."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes


def kv_cache_bytes(shape: ModelShape, rows: int, tokens: int, dtype_bytes: int) -> int:
    """transformers' DynamicCache of `rows` sequences of `tokens` positions."""
    return rows * tokens * kv_bytes_per_token(shape, dtype_bytes)


def prefill_bytes(shape: ModelShape, rows: int, prompt_tokens: int, dtype_bytes: int) -> int:
    """The prefill's largest transient: one layer's MLP and attention tensors over every prompt token."""
    per_token = (
        PREFILL_INTERMEDIATE_TENSORS * shape.intermediate_size + PREFILL_HIDDEN_TENSORS * shape.hidden_size
    )
    return rows * prompt_tokens * per_token * dtype_bytes


def sampling_bytes(shape: ModelShape, rows: int, dtype_bytes: int, top_p: float) -> int:
    """One sampling step's logits and their copies (see SAMPLING_BYTES_PER_LOGIT)."""
    per_logit = dtype_bytes + SAMPLING_BYTES_PER_LOGIT + (TOP_P_BYTES_PER_LOGIT if top_p < 1 else 0)
    return rows * shape.vocab_size * per_logit


@dataclass(frozen=True)
class GenerationTime:
    """Seconds of one generate call on one rank (per generation, not per optimizer step)."""

    prefill: float
    decode: float
    gather: float
    """ZeRO-3: the whole model gathered for the call (interconnect, and the host link under parameter offload)."""
    old_logps: float
    """num_iterations > 1: the generating policy's log-probs of every micro-batch, one forward each."""
    tokens: int
    """Completion tokens the call writes (every completion at max_completion_length)."""
    decode_step: float
    """Seconds of one decode step."""
    bound: str
    """What bounds a decode step: "memory bandwidth", "compute" or "launch overhead"."""

    @property
    def total(self) -> float:
        return self.prefill + self.decode + self.gather + self.old_logps

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total if self.total > 0 else 0.0


def decode_step_seconds(
    shape: ModelShape,
    weight_read_bytes: float,
    cache_read_bytes: float,
    rows: int,
    peak_flops: float,
    memory_bytes_per_s: float,
) -> tuple[float, str]:
    """(seconds, what bounds it) of one decode step of `rows` sequences: the largest of streaming the weights
    and the cache, the matmuls' compute (2 FLOPs per weight per row), and the per-layer launch overhead."""
    bounds = {
        "memory bandwidth": (weight_read_bytes + cache_read_bytes)
        / (memory_bytes_per_s * DECODE_BANDWIDTH_EFFICIENCY),
        "compute": 2.0 * shape.num_params * rows / peak_flops,
        "launch overhead": shape.num_layers * DECODE_SECONDS_PER_LAYER,
    }
    bound = max(bounds, key=lambda k: bounds[k])
    return bounds[bound], bound
