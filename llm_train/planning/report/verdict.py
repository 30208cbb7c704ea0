"""`llm-train plan --recipe NAME`: the verdict for a recipe on given hardware, and how it reads.

Three verdicts: FITS; FITS BUT IMPRACTICAL (it fits, but nobody would run it: see
search/fixes.py `judge`), with why and what to do instead; DOES NOT FIT (TIGHT when only the GPU
headroom is missing), with the cheapest changes that make it fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from llm_train.config.hardware import GPU_HEADROOM, DriveSpeeds, Hardware, hardware_for
from llm_train.config.objectives import objective_spec
from llm_train.config.recipe import load_recipe
from llm_train.config.resolution import Resolved, resolve_run
from llm_train.planning.memory.estimate import _LABELS, estimate_memory
from llm_train.planning.memory.host import host_buffers, offload_rank
from llm_train.planning.memory.inputs import MemoryInputError, MemoryInputs
from llm_train.planning.memory.offload_buffers import PINNINGS
from llm_train.planning.model.shapes import shape_from_config
from llm_train.planning.report.vision_note import vision_note
from llm_train.planning.search.candidate import (
    CPU_PROCESS_HOST_BYTES,
    TYPICAL_COST,
    Evaluation,
    evaluate,
    memory_inputs,
    needs,
)
from llm_train.planning.search.fixes import (
    Fix,
    Practicality,
    judge,
    long_context_text,
    search_faster,
    search_fixes,
    without_nvme,
)
from llm_train.planning.search.host_settings import choose_host_settings
from llm_train.planning.search.host_settings import describe as describe_host_settings
from llm_train.planning.speed.checkpoint_cost import _duration, checkpoint_lines
from llm_train.planning.speed.step_time import reference_pass_seconds, staged_load
from llm_train.units import GiB

# --- the report -------------------------------------------------------------------------------------


@dataclass
class PlanReport:
    title: str
    hardware: Hardware
    config_line: str
    evaluation: Evaluation
    fixes: list[Fix] = field(default_factory=list)
    faster: list[Fix] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    practicality: Practicality = field(default_factory=Practicality)
    nvme_bytes: int = 0
    """NVMe space per node the user declared (--nvme-gib); 0 = none."""
    pinning_rows: list[str] = field(default_factory=list)
    """The offload buffers under each pinning choice (pinning_table)."""

    @property
    def fits(self) -> bool:
        return self.evaluation.fits

    @property
    def word(self) -> str:
        """FITS, FITS BUT IMPRACTICAL or DOES NOT FIT (or TIGHT)."""
        return verdict_word(self.evaluation, self.hardware, self.practicality)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def verdict_word(ev: Evaluation, hw: Hardware, practicality: Practicality | None = None) -> str:
    """FITS, FITS BUT IMPRACTICAL (only when `practicality` says so), TIGHT or DOES NOT FIT."""
    if ev.fits:
        return "FITS BUT IMPRACTICAL" if practicality is not None and not practicality.practical else "FITS"
    if hw.kind == "cuda" and ev.device_bytes <= hw.gpu_mem_bytes and ev.fits_host and ev.fits_nvme:
        return "TIGHT"
    return "DOES NOT FIT"


def verdict(
    ev: Evaluation, hw: Hardware, practicality: Practicality | None = None, nvme_bytes: int = 0
) -> str:
    """One line: the verdict word, then GPU, host RAM (and NVMe) against what the hardware has."""
    parts = []
    if hw.kind == "cuda":
        spare = hw.gpu_mem_bytes - ev.device_bytes
        parts.append(
            f"GPU {ev.device_bytes / GiB:.1f} of {hw.gpu_mem_bytes / GiB:.1f} GiB "
            f"({spare / GiB:+.1f} GiB, {spare / hw.gpu_mem_bytes:+.0%})"
        )
    usable = hw.host_limit_bytes
    spare_host = usable - ev.host_bytes
    parts.append(
        f"host RAM {ev.host_bytes / GiB:.1f} of {usable / GiB:.1f} GiB usable "
        f"({spare_host / GiB:+.1f} GiB, {spare_host / max(1, usable):+.0%}; "
        f"{(hw.host_ram_bytes - usable) / GiB:.0f} of {hw.host_ram_bytes / GiB:.0f} GiB kept for the OS)"
    )
    if ev.estimate.nvme_bytes:
        declared = f"of {nvme_bytes / GiB:.0f} GiB (--nvme-gib)" if nvme_bytes else "(no --nvme-gib given)"
        parts.append(f"NVMe {ev.estimate.nvme_bytes / GiB:.1f} GiB {declared}")
    word = verdict_word(ev, hw, practicality)
    if word == "TIGHT":
        word = f"TIGHT (under {GPU_HEADROOM:.0%} of GPU memory to spare; the estimate is +-15%)"
    elif word == "DOES NOT FIT":
        short = []
        if not ev.fits_device:
            short.append("GPU memory")
        if not ev.fits_host:
            short.append("host RAM")
        if not ev.fits_nvme:
            short.append("NVMe: pass --nvme-gib N, the free space on the drive" if not nvme_bytes else "NVMe")
        word = f"DOES NOT FIT ({' and '.join(short)})"
    elif word == "FITS BUT IMPRACTICAL" and practicality is not None:
        word = f"FITS BUT IMPRACTICAL ({'; '.join(practicality.reasons)})"
    return f"{word}: " + "; ".join(parts)


def render(report: PlanReport) -> str:
    ev, hw = report.evaluation, report.hardware
    lines = [report.title, f"hardware: {hw.describe()}", f"config:   {report.config_line}", ""]
    lines.append("memory estimate" + ("" if hw.kind == "cuda" else " (CPU run: all of it is host RAM)"))
    rows = ev.estimate.table() if hw.kind == "cuda" else cpu_rows(ev)
    for key, value in rows:
        lines.append(f"  {key:<44} {value:>11}")
    t = ev.time
    parts = [f"compute {t.compute:.2f}s"]
    for label, seconds in (
        ("generation", t.generation),
        ("4-bit dequantisation", t.dequantize),
        ("ZeRO comm", t.communication),
        (f"PCIe {t.pcie_bytes / 1e9:.0f} GB", t.pcie),
        ("CPU Adam", t.cpu_optimizer),
        ("NVMe", t.nvme),
    ):
        if seconds:
            parts.append(f"{label} {seconds:.2f}s")
    if t.nvme:
        parts[-1] += (
            f": read {t.nvme_read_bytes / 1e9:.0f} GB at {hw.nvme_read_bytes_per_s / 1e9:g} GB/s, write "
            f"{t.nvme_write_bytes / 1e9:.0f} GB at {hw.nvme_write_bytes_per_s / 1e9:g} GB/s"
        )
    overlap = f"; ~{t.overlapped:.2f} s/step if prefetch hides the copies" if t.pcie_hideable >= 0.005 else ""
    lines.append(
        f"speed (rough model): ~{t.total:.2f} s/step, ~{t.tokens_per_s:,.0f} tokens/s ({', '.join(parts)}{overlap})"
    )
    if line := generation_line(ev):
        lines.append(line)
    lines.append("")
    lines.append("verdict: " + verdict(ev, hw, report.practicality, report.nvme_bytes))
    if report.practicality.instead:
        lines.append(f"instead:  {report.practicality.instead}")
    if report.fixes:
        lines.append("")
        lines.append("cheapest changes that make it fit, fastest first (speed vs the recipe as written):")
        lines.extend(_fix_lines(report.fixes, hw))
    elif not ev.fits:
        lines.append("")
        lines.append(
            "does not fit anywhere: no combination of checkpointing, smaller micro-batch, ZeRO-3, CPU "
            f"offload{'' if report.nvme_bytes else ' (NVMe only with --nvme-gib)'}, bf16 optimizer states, "
            "LoRA, QLoRA (on GPUs) and, for GRPO under ZeRO-3, layer-by-layer generation fits this hardware; add "
            "GPUs (--gpus), use bigger cards, or more host RAM"
        )
    if report.faster:
        lines.append("")
        lines.append("faster options that also fit (spare memory spent on speed):")
        lines.extend(_fix_lines(report.faster, hw))
    if report.pinning_rows:
        lines.append("")
        lines.extend(report.pinning_rows)
    for note in report.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def pinning_table(inp: MemoryInputs, hw: Hardware) -> list[str]:
    """The offload buffers of one node under each pinning choice (deepspeed.pinning), as DeepSpeed allocates
    them (planning/memory/offload_buffers.py), with the host total and what one process locks."""
    buffers = host_buffers(inp)
    if not buffers:
        return []
    ranks = inp.ranks_per_node
    choices = [inp.vary(pinning=p, param_pinning=p) for p in PINNINGS]
    ours = next(
        p for p in PINNINGS if (inp.pinning, inp.param_pinning) in ((p, p), (p, "torch"), ("torch", p))
    )
    width = max(len(b.what) for b in buffers) + 2
    head = "".join(f"{p + (' *' if p == ours else ''):>10}" for p in PINNINGS)
    lines = [
        "host buffers per pinning choice (deepspeed.pinning; GiB per node; * this run):",
        f"  {'':<{width}}{head}",
    ]
    held = []  # per choice: buffer -> bytes on the node (unpinned, zero.Init's blocks are freed: absent)
    for c in choices:
        rank = offload_rank(c)
        held.append({(b.term, b.what): ranks * b.held(rank.pinning_of(b)) for b in host_buffers(c)})
    whats = list(dict.fromkeys((b.term, b.what) for c in choices for b in host_buffers(c)))
    width = max(len(what) for _, what in whats) + 2
    lines[1] = f"  {'':<{width}}{head}"
    for key in whats:
        values = [h.get(key, 0.0) for h in held]
        lines.append(f"  {key[1]:<{width}}" + "".join(f"{v / GiB:>10.2f}" for v in values))
    estimates = [needs(estimate_memory(c), c, hw.kind)[1] for c in choices]
    lines.append(
        f"  {'host RAM total (the estimate above)':<{width}}"
        + "".join(f"{v / GiB:>10.2f}" for v in estimates)
    )
    locked = [estimate_memory(c).locked_per_rank for c in choices]
    lines.append(
        f"  {'mlocked per process (memlock limit)':<{width}}" + "".join(f"{v / GiB:>10.2f}" for v in locked)
    )
    return lines


def cpu_rows(ev: Evaluation) -> list[tuple[str, str]]:
    """The estimate of a CPU run: per-process tensors (the 'GPU' terms) and the node's total."""

    est, ranks = ev.estimate, ev.inputs.ranks_per_node
    rows = [
        (f"per process: {_LABELS.get(k, k)}", _gib(v))
        for k, v in est.gpu_terms.items()
        if k != "cuda_context_and_slack"
    ]
    if est.generation_terms:  # GRPO: generation runs between steps, beside the states training holds
        rows += [(f"per process: {_LABELS.get(k, k)}", _gib(v)) for k, v in est.generation_terms.items()]
        total = "per process total (larger phase, +10% slack)"
        rows.append((total, _gib(ev.device_bytes)))
    else:
        rows.append(("per process total (+10% allocator slack)", _gib(ev.device_bytes)))
    rows += [
        (f"host {_LABELS.get(k, k)}", _gib(v))
        for k, v in est.host_terms.items()
        if v and k != "process_overhead"
    ]
    rows.append((f"host {ranks} process(es): torch, Python (no CUDA)", _gib(ranks * CPU_PROCESS_HOST_BYTES)))
    rows.append(("host RAM total (per node, all processes)", _gib(ev.host_bytes)))
    return rows


def _fix_lines(fixes: list[Fix], hw: Hardware) -> list[str]:
    lines = []
    for i, fix in enumerate(fixes, 1):
        fe = fix.evaluation
        gpu = f"GPU {fe.device_bytes / GiB:.1f} GiB, " if hw.kind == "cuda" else ""
        nvme = f", NVMe {fe.estimate.nvme_bytes / GiB:.0f} GiB" if fe.estimate.nvme_bytes else ""
        lines.append(f"  {i}. {_slowdown(fix.slowdown)}  ({gpu}host {fe.host_bytes / GiB:.1f} GiB{nvme})")
        if fix.impractical:
            lines.append(f"       FITS BUT IMPRACTICAL: {fix.impractical}")
        for change in fix.changes:
            lines.append(f"       - {change.text}  [{TYPICAL_COST[change.kind]}]")
        lines.append(f"       overrides: {' '.join(fix.overrides)}")
    return lines


def _slowdown(ratio: float) -> str:
    if ratio >= 1.005:
        return f"{ratio - 1:+.0%} step time"
    if ratio <= 0.995:
        return f"{ratio - 1:+.0%} step time (faster)"
    return "same speed"


def config_line(inp: MemoryInputs, grad_accum: int) -> str:
    offload = (
        f"offload optimizer={inp.offload_optimizer} params={inp.offload_params}"
        if inp.offload_optimizer != "none" or inp.offload_params != "none"
        else "no offload"
    )
    what = f"LoRA r={inp.lora_rank}" if inp.lora_rank else "full fine-tune"
    if inp.quantize != "none":
        what = f"QLoRA ({inp.quantize} base) r={inp.lora_rank}"
    if inp.state_dtype == "bf16":
        offload += " (bf16 optimizer states)"
    micro = (
        f"{inp.micro_batch} pairs ({inp.rows} rows)"
        if inp.sequences_per_sample == 2
        else str(inp.micro_batch)
    )
    if inp.reference != "none":
        what += f", DPO reference {inp.reference}"
    return (
        f"{what}, ZeRO-{inp.zero_stage}, {offload}, {inp.precision}, micro {micro} x accum "
        f"{grad_accum} x dp {inp.dp}, seq {inp.seq_len}, checkpointing "
        f"{'on' if inp.activation_checkpointing else 'off'}, {inp.attn_impl}{long_context_text(inp, prefix=', ')}"
    )


def plan_recipe(
    recipe_name: str,
    overrides: list[str],
    gpus: int | None = None,
    gpu: str | None = None,
    gpu_mem_gib: float | None = None,
    host_ram_gib: float | None = None,
    detect: bool = True,
    nvme_gib: float | None = None,
    drive: DriveSpeeds | None = None,
) -> PlanReport:
    """The plan for a recipe on the given (or detected, or declared) hardware.

    nvme_gib: NVMe space per node for offload (--nvme-gib); without it NVMe configurations do not fit.
    drive: Hardware's nvme_read_bytes_per_s / nvme_write_bytes_per_s (--nvme-read-gbs, --nvme-write-gbs).
    """

    recipe = load_recipe(recipe_name, overrides)
    hw = dataclasses.replace(
        hardware_for(gpus, gpu, gpu_mem_gib, host_ram_gib, recipe, detect), **(drive or {})
    )
    run = resolve_run(recipe_name, overrides, world_size=hw.gpus, device=hw.device())
    shape = shape_from_config(run.model_fields)
    base = memory_inputs(run, shape, hw.gpus_per_node)
    nvme = int((nvme_gib or 0) * GiB)
    ev = evaluate(base, hw, nvme)
    kind = (
        shape.vision.family if shape.vision is not None else shape.model_type
    )  # an image-text model's own type
    model = run.recipe.model.name_or_path or f"random {kind}"
    title = f"llm-train plan: {run.recipe.name} ({model}, {shape.num_params / 1e9:.2f}B parameters)"
    if shape.num_params < 1e8:
        title = f"llm-train plan: {run.recipe.name} ({model}, {shape.num_params / 1e6:.1f}M parameters)"
    report = PlanReport(title, hw, config_line(base, run.layout.grad_accum), ev, nvme_bytes=nvme)
    if run.notice:
        report.notes.append(run.notice)
    if vision := vision_note(base, ev.estimate):
        report.notes.append(vision)
    report.notes.extend(f"checkpoints: {line}" for line in checkpoint_lines(run))
    if start := start_up_note(base, hw):
        report.notes.append(start)
    tight = hw.kind == "cuda" and ev.device_bytes > hw.gpu_limit_bytes
    if not ev.fits or tight:
        report.fixes = search_fixes(base, run.layout.grad_accum, hw, run.recipe, nvme_bytes=nvme)
        alternatives = without_nvme(base, hw)
        for fix in report.fixes:
            fix.impractical = "; ".join(judge(fix.evaluation, alternatives).reasons)
    else:
        report.practicality = judge(ev, without_nvme(base, hw))
        report.faster = search_faster(base, run.layout.grad_accum, hw, run.recipe, nvme_bytes=nvme)
    report.pinning_rows = pinning_table(base, hw)
    if base.offload_optimizer != "none" and hw.kind == "cuda":
        report.notes.append(describe_host_settings(choose_host_settings(base, hw), base))
    saving = bf16_states_note(base, hw)
    if saving:
        report.notes.append(saving)
    spec = objective_spec(run.recipe.objective)
    if spec.section == "preference":
        report.notes.append(preference_note(ev, run.recipe.objective, run.layout.grad_accum, hw))
    if spec.generates:
        report.notes.append(grpo_note(run))
    if ev.estimate.nvme_bytes:
        report.notes.append(
            f"NVMe: before start, deepspeed.nvme_path is checked for {ev.estimate.nvme_bytes / 2**30:.1f} GiB "
            "free per node (and that it exists and is writable)"
        )
    return report


def start_up_note(inp: MemoryInputs, hw: Hardware) -> str | None:
    """How long an nf4 base staged under ZeRO-3 takes to load (speed.staged_load), at every start and resume."""
    load = staged_load(inp, hw.nvme_read_bytes_per_s, hw.pcie_bytes_per_s)
    if load is None:
        return None
    read = (
        f"each of {inp.ranks_per_node} processes reads the {load.checkpoint_bytes / 1e9:.0f} GB checkpoint "
        f"({_duration(load.read)} at {hw.nvme_read_bytes_per_s / 1e9:g} GB/s, the drive's: --nvme-read-gbs)"
    )
    if inp.quantize_on == "cpu":
        how = f"{read}, and bitsandbytes quantises it on the CPU ({_duration(load.quantize)})"
    else:
        how = (
            f"{read}, copies each weight to its GPU, where bitsandbytes quantises it, and the codes back "
            f"({_duration(load.copies)})"
        )
    return f"start-up: the 4-bit base loads in ~{_duration(load.total)}, at every start and resume: {how}"


def generation_line(ev: Evaluation) -> str | None:
    """GRPO's generate call by part (planning/memory/generation.py), and which part of the step dominates."""
    call, t, inp = ev.time.generation_call, ev.time, ev.inputs
    if call is None or inp.generation is None:
        return None
    gen = inp.generation
    extra = "".join(
        f", {label} {seconds:.2f}s"
        for label, seconds in (("ZeRO-3 gather", call.gather), ("old log-probs", call.old_logps))
        if seconds
    )
    every = f", once per {gen.num_iterations} steps" if gen.num_iterations > 1 else ""
    larger, smaller = ("generation", "training") if t.generation >= t.training else ("training", "generation")
    seconds = {"generation": t.generation, "training": t.training}
    return (
        f"generation (a rough model until measured): ~{call.total:.2f} s per generate call{every}: "
        f"{inp.generation_rows} completions of up to {gen.completion_tokens} tokens after prompts of up to "
        f"{gen.prompt_tokens(inp.seq_len)} (prefill {call.prefill:.2f}s, decode {call.decode:.2f}s at "
        f"~{call.decode_step * 1e3:.0f} ms per token, bound by {call.bound}{extra}), ~{call.tokens_per_s:,.0f} "
        f"tokens/s; {larger} dominates the step: ~{seconds[larger]:.2f}s against {smaller}'s ~{seconds[smaller]:.2f}s"
    )


def grpo_note(run: Resolved) -> str:
    """How the estimate above counts an online-RL run (docs/rl.md, "Memory and time")."""
    grpo = run.recipe.grpo
    return (
        f"objective grpo: each step generates {grpo.num_generations} completions per prompt of up to "
        f"{grpo.max_completion_length} tokens, a rank's whole step in one "
        f"{'continuous-batching generate_batch' if grpo.use_transformers_continuous_batching else 'generate'} "
        "call: its key-value cache, "
        "prefill, sampling"
        + (
            (
                " and the ZeRO-3 gathered model"
                if grpo.ds3_gather_for_generation
                else " and one ZeRO-3 gathered layer"
            )
            if run.layout.zero_stage == 3
            else ""
        )
        + " are counted beside the states training holds; the GPU peak is the larger phase"
        + (
            "; beta > 0 adds the reference's forward (and, without LoRA, its frozen copy)"
            if grpo.beta
            else ""
        )
    )


def preference_note(ev: Evaluation, objective: str, grad_accum: int, hw: Hardware) -> str:
    """What a preference run adds: two sequences per pair, and the reference's pass or memory."""
    inp = ev.inputs
    line = (
        f"objective {objective}: each pair trains two sequences (chosen, rejected): micro {inp.micro_batch} "
        f"pairs = {inp.rows} rows of up to {inp.seq_len} tokens, counted above"
    )
    if inp.reference == "none":
        return f"{line}; reference-free: no reference model and no reference pass"
    if inp.reference == "cached":
        seconds = reference_pass_seconds(inp, grad_accum, hw.peak_tflops)
        return (
            f"{line}; reference log-probs cached: one forward pass over the pairs before step 1, ~{seconds:.2f}s "
            f"per optimizer step's pairs (~{seconds / ev.time.total:.0%} of a training step) for every pair of "
            "the data, then no reference memory or compute; a live reference scores only the pairs trained, "
            "so under a fraction of an epoch it costs less"
        )
    if inp.reference_copy:
        copy = ev.estimate.gpu_terms.get("reference_model", 0) + ev.estimate.host_terms.get(
            "offloaded_reference_parameters", 0
        )
        return (
            f"{line}; live reference: a frozen copy of the model ({copy / GiB:.2f} GiB per GPU or offloaded, "
            "counted above) and one more forward per micro-batch (counted in the step time); "
            "preference.reference=cached needs neither"
        )
    return (
        f"{line}; live reference: the base with the LoRA adapters disabled (no second copy), one more forward "
        "per micro-batch (counted in the step time)"
    )


def bf16_states_note(inp: MemoryInputs, hw: Hardware) -> str | None:
    """What bf16 optimizer states save (or saved) in host RAM, for a run that offloads its optimizer to CPU."""
    other = "fp32" if inp.state_dtype == "bf16" else "bf16"
    try:
        alt = inp.vary(state_dtype=other)
    except MemoryInputError:
        return None  # not a CPU-offloaded bf16 run: the knob does not apply
    ours, theirs = evaluate(inp, hw).host_bytes, evaluate(alt, hw).host_bytes
    if other == "bf16":
        return (
            f"bf16 optimizer states would save {(ours - theirs) / GiB:.1f} GiB host RAM "
            f"({ours / GiB:.1f} -> {theirs / GiB:.1f} GiB): optim.state_dtype=bf16, at a measured quality cost "
            "(eval loss +0.14 at lr 1e-5, +0.09 at 1e-4 on a tiny model: bench/results/bf16-states-quality-*.txt)"
        )
    return (
        f"bf16 optimizer states save {(theirs - ours) / GiB:.1f} GiB host RAM here "
        f"({theirs / GiB:.1f} GiB with optim.state_dtype=fp32), at a measured quality cost "
        "(bench/results/bf16-states-quality-*.txt)"
    )
