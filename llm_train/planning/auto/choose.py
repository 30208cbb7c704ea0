"""`--recipe auto`: the fastest configuration of a model that fits given hardware, as a recipe.

One search over the knobs of planning/auto/knobs.py (DS JSON and its pinning, micro-batch, checkpointing,
the long-context switches) for each kind of training (full, LoRA, QLoRA), each candidate a variation of
its kind's base: the recipe auto writes for that kind, with the user's overrides applied, resolved as any
recipe is (config/resolution.py, planning/search/candidate.memory_inputs). So an override is planned: a knob it
sets stays at the value it resolves to, any other key reaches the estimate through the same resolution,
any lora.* key plans adapters only, and one the planner does not model is refused in one line
(knobs.NOT_PLANNED). The written recipe is that base with the chosen knobs, and `check_written` holds it
to that: read back and planned from scratch it gives the chosen candidate's inputs and numbers, or the
command refuses in one line before writing.

The choice policy (docs/planning.md, "The choice policy"): the fastest that fits within a kind, without
NVMe before NVMe (only with --nvme-gib); a practical full fine-tune over faster adapters, with the cost
printed (`policy_cost`); adapters where no full fine-tune fits or it is impractical (search/fixes.py `judge`),
unless --no-lora. Adapters are 16-bit LoRA or QLoRA (the same adapters on a 4-bit base, bitsandbytes,
CUDA only), weighed by the same speed model: the fastest that fits is chosen (QLoRA by more than
EXACT_BASE_MARGIN), and the "why" names the runner-up with both step times. Optimizer states stay fp32: bf16 states (optim.state_dtype=bf16) halve the offloaded
optimizer's host RAM, but their measured quality cost is too high to pick them for anyone
(bench/results/bf16-states-quality-*.txt: at lr 1e-5 they kept 8% of fp32's eval-loss gain), so
`plan` only reports what they would save.

Pinning is a knob of the offloading candidates: native (exact size, needs the memlock limit of this
shell: planning/memory/pinning.py), torch (DeepSpeed's default, rounded up to powers of two, no limit) or off
(pageable: slower copies that hide behind nothing, planning/speed/step_time.py). The chosen one is written as it
is, not as `auto`, so the run gets the pinning its plan assumed.

The attention kernel is planned and written too: sdpa_flex on CUDA where torch has flex_attention
(no dense s x s mask), sdpa under sequence parallelism or without it.

Long sequences: when no configuration of a kind fits at --seq-len, the DeepSpeed ALST techniques join
the candidates: Ulysses sequence parallelism (search.sequence_parallel_degrees) and the tiled MLP,
tiled loss and checkpoint-offload switches. They train exactly the same model, so a full fine-tune with
them comes before adapters.

The parts, one module each: auto_base.py (the request, the kinds as recipes, how candidates rank),
this module (the candidates, the search and the pick), auto_reasons.py (every "why" line) and
auto_written.py (the recipe written, checked and printed).
"""

from __future__ import annotations

import itertools

from llm_train.config.attention_kernel import FLEX_KERNELS
from llm_train.config.hardware import Hardware
from llm_train.errors import UserError
from llm_train.planning.auto.reasons import (
    lighter_misses,
    lora_reasons,
    nowhere,
    policy_cost,
    runner_up,
    technique_reasons,
)
from llm_train.planning.auto.request import (
    CHUNKED_LOSS,
    EXACT_BASE_MARGIN,
    FULL,
    LONG_CONTEXT_PINS,
    NO_ALST,
    AutoRequest,
    Kind,
    auto_request,
    fastest_fitting,
    kind_of,
    prefer_exact_base,
)
from llm_train.planning.auto.written import (
    AutoChoice,
    check_written,
)
from llm_train.planning.memory.inputs import MemoryInputError, MemoryInputs
from llm_train.planning.memory.pinning import MemlockLimit
from llm_train.planning.search.candidate import (
    AUTO_MICRO_BATCHES,
    Evaluation,
    evaluate,
    loader_forks_for,
    zero_init_for,
)
from llm_train.planning.search.fixes import (
    judge,
    long_context_options,
)


def choose_auto(
    model: str,
    hw: Hardware,
    seq_len: int | None = None,
    global_batch: int = 64,
    lora: str = "fallback",
    nvme_gib: float | None = None,
    overrides: list[str] | None = None,
    memlock: MemlockLimit | None = None,
) -> AutoChoice:
    """The fastest configuration (by the speed model) that fits `hw`, in the order of the module docstring.

    lora: "fallback" = adapters only when no full fine-tune fits, or the one that fits is impractical;
    "never"; "always". nvme_gib: NVMe space per node (--nvme-gib); without it no NVMe offload.
    overrides: the user's `key=value`s, planned (module docstring). memlock: the limit native pinning
    must fit (default: this process's).
    A composer: the request, the candidates of each kind evaluated, the pick, then why.
    """
    ask = auto_request(model, hw, seq_len, global_batch, nvme_gib, overrides or [], lora, memlock)
    full_tried = fitting_search(ask, FULL) if FULL in ask.kinds else []
    adapters_all = lora_search(ask)
    adapters_tried = adapters_all if lora != "never" else []
    tried = full_tried + adapters_tried
    # A verdict judges the configuration against everything this hardware could run instead, adapters
    # included even under --no-lora: the flag says what to choose, not how fast the choice is.
    alternatives = full_tried + adapters_all
    chosen, fitting, reasons = pick(ask, full_tried, adapters_tried, alternatives, lora)
    practicality = judge(chosen, alternatives)
    exact = " with a 16-bit base" if chosen is not fastest_fitting(fitting)[0] else ""
    kind = "adapter" if chosen.inputs.lora_rank else "full fine-tune"
    reasons.append(
        f"the fastest of the {len(fitting)} {kind} configurations that fit{exact} ({len(tried)} estimated, of "
        "every kind planned), by the step time that counts every host copy whole (that prefetch hides them is "
        "assumed, not measured)"
    )
    if not chosen.inputs.lora_rank:
        reasons += policy_cost(chosen, alternatives, lora)
    reasons += runner_up(chosen, fitting)
    reasons += lighter_misses(ask, chosen, tried)
    reasons += technique_reasons(ask, chosen, tried, lora)
    auto = AutoChoice(
        chosen,
        hw,
        model,
        ask.shape,
        chosen.inputs.seq_len,
        ask.global_batch,
        reasons,
        practicality,
        ask.nvme_bytes,
        list(overrides or []),
        ask.recipe.deepspeed.config if "ds_key" in ask.pins else None,
        ask.kind_bases[kind_of(chosen.inputs)].data,
    )
    check_written(auto)
    return auto


def candidates(
    ask: AutoRequest, kind: Kind, long_context: list[tuple[int, bool, bool, bool]]
) -> list[MemoryInputs]:
    """Every DS JSON x pinning x micro-batch x checkpointing x long-context option of one kind that the layout
    (and sequence-parallel) rules accept and whose micro-batch divides the global batch over the layout's
    data-parallel ranks; pinned knobs stay. Each varies the kind's own resolved recipe (KindBase), so what
    the search does not turn is what the written recipe says."""
    base = ask.kind_bases[kind].inputs
    quantize = kind[1]
    micros = [base.micro_batch] if "micro_batch" in ask.pins else list(AUTO_MICRO_BATCHES)
    ckpts = [base.activation_checkpointing] if "activation_checkpointing" in ask.pins else [False, True]
    out = []
    for mode, micro, ckpt, (sp, tiled_mlp, tiled_loss, offload_ckpt) in itertools.product(
        ask.modes, micros, ckpts, long_context
    ):
        # Data-parallel ranks: tensor-parallel groups, pipeline stages and sequence-parallel groups share GPUs.
        ranks = base.world_size // (base.tp * base.pp * sp)
        if ranks < 1 or ask.global_batch % (micro * ranks):
            continue
        attention = base.attn_impl
        if sp > 1 and attention in FLEX_KERNELS and "attn_impl" not in ask.pins:
            attention = "sdpa"  # Ulysses wraps sdpa or flash-attention only
        for pinning in ask.pinnings(mode):
            settings = dict(ask.ds_settings(mode, pinning))  # shipped_settings is cached: never edit its dict
            if sp > 1 and mode[0] == 3:
                # What the run's effective DS JSON does under Ulysses with ZeRO-3 (ds_json.effective_config):
                # the reduce bucket grows to the largest weight, so every gradient takes the all-reduce path.
                settings["reduce_bucket_size"] = max(settings["reduce_bucket_size"] or 0, ask.largest_weight)
            try:
                candidate = base.vary(
                    **settings,
                    zero_stage=mode[0],
                    offload_optimizer=mode[1],
                    offload_params=mode[2],
                    micro_batch_size=micro,
                    grad_accum=ask.global_batch // (micro * ranks),
                    sp=sp,
                    activation_checkpointing=ckpt,
                    zero_init=zero_init_for(quantize),  # follows the stage (or a quantised base's loader)
                    attn_impl=attention,
                    tiled_mlp=tiled_mlp,
                    tiled_loss=tiled_loss,
                    offload_checkpoints=offload_ckpt,
                    loader_forks=loader_forks_for(ask.recipe.data.loader_workers, mode[1], ask.on_gpu),
                )
            except MemoryInputError:
                continue  # a combination the layout (or sequence-parallel, or QLoRA) rules refuse
            out.append(candidate)
    return out


def fitting_search(ask: AutoRequest, kind: Kind) -> list[Evaluation]:
    """The candidates of one kind evaluated: without ALST (with and without the chunked loss); with ALST too
    when nothing fits without (only a long sequence needs it). Native pinning that would lock more than the
    memlock limit allows is left out."""
    first = [ask.base.long_context] if ask.pins & LONG_CONTEXT_PINS else [NO_ALST, CHUNKED_LOSS]
    out = _evaluate(ask, candidates(ask, kind, first))
    if not any(e.fits for e in out) and not ask.pins & LONG_CONTEXT_PINS:
        options = [o for o in long_context_options(ask.base)[1:] if o != CHUNKED_LOSS]
        out += _evaluate(ask, candidates(ask, kind, options))
    return out


def _evaluate(ask: AutoRequest, inputs: list[MemoryInputs]) -> list[Evaluation]:
    out = []
    for c in inputs:
        ev = evaluate(c, ask.hw, ask.nvme_bytes)
        native = "native" in (c.pinning, c.param_pinning)
        if native and "pinning" not in ask.pins and not ask.memlock.allows(ev.estimate.locked_per_rank):
            continue  # this shell could not lock it: torch's allocator or pageable buffers instead
        out.append(ev)
    return out


def lora_search(ask: AutoRequest) -> list[Evaluation]:
    """Adapter candidates evaluated: 16-bit LoRA and QLoRA (the same adapters on a 4-bit base) side by side."""
    return [e for kind in ask.kinds if kind[0] for e in fitting_search(ask, kind)]


def pick(
    ask: AutoRequest,
    full_tried: list[Evaluation],
    lora_tried: list[Evaluation],
    alternatives: list[Evaluation],
    lora: str,
) -> tuple[Evaluation, list[Evaluation], list[str]]:
    """(the choice, the fitting configurations of its kind, why LoRA when it is LoRA).

    The fastest full fine-tune that fits, unless it is impractical and a practical LoRA fits; else the
    fastest LoRA that fits; else UserError with the closest miss.
    """
    full, full_fitting = fastest_fitting(full_tried)
    best_lora, lora_fitting = fastest_fitting(lora_tried)
    exact_base: list[str] = []
    if best_lora is not None and (preferred := prefer_exact_base(best_lora, lora_fitting)) is not best_lora:
        exact_base.append(
            f"the base stays 16-bit: the fastest QLoRA (the runner-up below) is faster by under "
            f"{EXACT_BASE_MARGIN - 1:.0%}, inside the rough speed model's error, and a 4-bit base changes every "
            "frozen weight"
        )
        best_lora = preferred
    full_verdict = judge(full, alternatives) if full is not None else None
    # LoRA replaces an impractical full fine-tune only when it is practical itself.
    lora_helps = best_lora is not None and judge(best_lora, alternatives).practical
    if full is not None and full_verdict is not None and (full_verdict.practical or not lora_helps):
        return full, full_fitting, []
    if best_lora is None:
        kinds = [k for k in ask.kinds if lora != "never" or k == FULL]
        raise UserError(nowhere(ask.model, ask.hw, full_tried + lora_tried, kinds, ask.nvme_bytes))
    reasons = lora_reasons(ask, full, full_verdict, best_lora, lora, full_tried, lora_tried)
    return best_lora, lora_fitting, reasons + exact_base
