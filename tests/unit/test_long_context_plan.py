"""Long context in the planner: Ulysses sequence parallelism and the ALST memory switches in the memory
estimate, in `llm-train plan` and `--recipe auto`, and docs/long-context.md's longest-sequence table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llm_train import RECIPES_DIR, cli
from llm_train.config.attention_kernel import Installed
from llm_train.config.hardware import hardware_for
from llm_train.config.recipe import load_recipe
from llm_train.planning.auto.choose import choose_auto
from llm_train.planning.memory.estimate import estimate_memory
from llm_train.planning.memory.formulas import (
    LOSS_CHUNK_LOGITS_BYTES,
    logits_bytes,
    loss_chunks,
    mlp_intermediate_bytes_per_token,
    mlp_tile_bytes,
)
from llm_train.planning.memory.inputs import MemoryInputError, MemoryInputs
from llm_train.planning.model.shapes import shape_of
from llm_train.planning.report.verdict import plan_recipe
from llm_train.planning.search.candidate import evaluate
from llm_train.planning.search.long_context import SEQ_STEP, best_fit, long_context_table, render_table
from llm_train.planning.speed.step_time import step_time
from llm_train.units import GiB

LLAMA31_8B = shape_of("meta-llama/Llama-3.1-8B")  # h=4096, L=32, 32 heads, 8 KV heads, V=128256, i=14336
H, L, V, INTER = 4096, 32, 128256, 14336
S = 131072


def inputs(**kw: object) -> MemoryInputs:
    base: dict[str, object] = {
        "shape": LLAMA31_8B,
        "world_size": 8,
        "zero_stage": 3,
        "seq_len": S,
        "activation_checkpointing": True,
    }
    return MemoryInputs.of(**{**base, **kw})  # type: ignore[arg-type]


def gpu(inp: MemoryInputs) -> dict[str, int]:
    return estimate_memory(inp).gpu_terms


# --- the estimate ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sp", [2, 4, 8])
def test_activations_and_logits_fall_as_one_over_sp(sp: int) -> None:
    # Every rank holds S/sp tokens of every activation (sdpa: no s x s term), so they are exactly 1/sp.
    one, split = gpu(inputs()), gpu(inputs(sp=sp))
    for term in ("activations", "logits_and_loss"):
        assert split[term] == pytest.approx(one[term] / sp, rel=1e-9), term
    for ckpt in (False, True):
        plain, parallel = (
            gpu(inputs(activation_checkpointing=ckpt)),
            gpu(inputs(sp=sp, activation_checkpointing=ckpt)),
        )
        assert parallel["activations"] == pytest.approx(plain["activations"] / sp, rel=1e-9)
    # The all-to-all: q, k, v and the output of the rank's S/sp tokens, 16-bit; none without SP.
    assert split["sequence_parallel_buffers"] == 4 * (S // sp) * H * 2
    assert "sequence_parallel_buffers" not in one


def test_sdpa_gets_an_s_by_s_mask_without_sequence_parallelism_only() -> None:
    seq = 32768
    masked = gpu(inputs(seq_len=seq, dense_mask=True, activation_checkpointing=True))
    # One bool mask per forward and the layer being computed's bf16 copy of it.
    assert masked["attention_mask"] == seq * seq * (1 + 2)
    assert "attention_mask" not in gpu(inputs(seq_len=seq, dense_mask=True, attn_impl="flash_attention_2"))
    assert "attention_mask" not in gpu(inputs(seq_len=seq, dense_mask=True, world_size=2, sp=2))
    assert "attention_mask" not in gpu(inputs(seq_len=seq))  # rows without a mask


def test_zero_partitions_over_the_sequence_parallel_ranks_too() -> None:
    # DeepSpeed partitions over the sequence-data-parallel group: dp 1 x sp 8 shards like dp 8.
    assert inputs(sp=8).dp == 1 and inputs(sp=8).zero_partitions == 8
    one, split = gpu(inputs()), gpu(inputs(sp=8))
    for term in ("parameters", "gradients", "optimizer_states"):
        assert split[term] == one[term], term


def test_tiled_loss_keeps_one_chunk_of_logits() -> None:
    full = gpu(inputs(sp=8))["logits_and_loss"]
    assert full == V * (S // 8) * 12  # 23.5 GiB: transformers' loss over 16k tokens (12 B per logit)
    tiled = gpu(inputs(sp=8, tiled_loss=True))["logits_and_loss"]
    # One chunk of at most 64 MiB of fp32 logits (12 B per logit at the peak: 3 times its fp32 bytes),
    # the gradient of the 16k hidden states, and (a full fine-tune) the output layer's
    # gradient of one chunk while it is added into the running one.
    head_grad = V * 4096 * 2
    assert tiled <= 3 * LOSS_CHUNK_LOGITS_BYTES + (S // 8) * 4096 * 2 + head_grad and tiled > head_grad
    assert full / tiled > 15
    # A short row is still cut: 1024 tokens of a 128k vocabulary are 8 chunks.
    assert loss_chunks(1024, V) == 8
    short = gpu(inputs(seq_len=1024, tiled_loss=True))["logits_and_loss"]
    assert short - head_grad < logits_bytes(LLAMA31_8B, 1024, 1) / 10


def test_tiled_mlp_keeps_one_tile_of_intermediates() -> None:
    per_token = mlp_intermediate_bytes_per_token(LLAMA31_8B)
    assert per_token == 8 * INTER  # gate, up, SiLU(gate), product in 16 bits
    plain = gpu(inputs(activation_checkpointing=False, sp=8))["activations"]
    tiled = gpu(inputs(activation_checkpointing=False, sp=8, tiled_mlp=True))["activations"]
    # Every layer drops its MLP intermediates; one tile of hidden_size tokens (with gradients) remains.
    assert plain - tiled == pytest.approx(L * (S // 8) * per_token - 2 * H * per_token, rel=1e-9)
    assert mlp_tile_bytes(LLAMA31_8B, S // 8, 1) == 2 * H * per_token


def test_checkpoint_offload_moves_the_checkpoints_to_host_ram() -> None:
    kept, offloaded = estimate_memory(inputs(sp=8)), estimate_memory(inputs(sp=8, offload_checkpoints=True))
    checkpoint = 2 * (S // 8) * H  # one layer's 16-bit input on one rank
    # The GPU keeps the one being copied; the host holds all 32 layers' for each of the 8 ranks.
    assert kept.gpu_terms["activations"] - offloaded.gpu_terms["activations"] == (L - 1) * checkpoint
    assert offloaded.host_terms["offloaded_checkpoints"] == 8 * L * checkpoint  # 256 GiB at 1M would be 8x
    assert "offloaded_checkpoints" not in kept.host_terms
    # They are a training-phase term: the host total holds them on top of the processes.
    host_terms = offloaded.host_terms
    assert offloaded.host_bytes >= host_terms["process_overhead"] + host_terms["offloaded_checkpoints"]
    assert offloaded.host_bytes > kept.host_bytes
    assert offloaded.gpu_bytes < kept.gpu_bytes


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"offload_checkpoints": True, "activation_checkpointing": False}, "needs activation_checkpointing"),
        ({"sp": 3, "world_size": 3}, "not divisible by 3"),
        ({"sp": 16, "world_size": 16}, "the model has 8"),  # 32 heads divide by 16, 8 KV heads do not
        ({"sp": 2, "tp": 2, "zero_stage": 1}, "cannot be combined"),
        ({"sp": 8, "world_size": 4}, "tp*pp*sp = 1*1*8"),
        ({"sp": 2, "attn_impl": "eager"}, "the run refuses eager"),
    ],
)
def test_impossible_long_context_inputs_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(MemoryInputError, match=re.escape(message)):
        inputs(**kwargs)


def test_the_switches_cost_speed_and_sequence_parallel_splits_compute() -> None:
    hw = hardware_for(8, "H100", None, 2048, None, detect=False)

    def seconds(inp: MemoryInputs) -> float:
        return step_time(
            inp,
            inp.grad_accum,
            hw.peak_tflops,
            hw.nvlink,
            hw.nvme_read_bytes_per_s,
            hw.nvme_write_bytes_per_s,
        ).total

    base = inputs(sp=8)
    for switch in ("tiled_mlp", "tiled_loss", "offload_checkpoints"):
        assert seconds(base.vary(**{switch: True})) > seconds(base), switch
    # One row on 8 GPUs (sp 8) against 8 rows on 8 GPUs (dp 8): per row, about 1/8 of the time.
    per_row_sp = seconds(base)
    per_row_dp = seconds(inputs(tiled_loss=True, tiled_mlp=True)) / 8
    assert per_row_sp == pytest.approx(per_row_dp, rel=0.1)


# --- the planner chooses ALST only when a long sequence needs it ------------------------------------------


# Longer than one H100 holds with any switch (256k: docs/long-context.md's table); at 128k the chunked loss
# alone now fits one GPU, which the search prefers to splitting the row.
LONG = 1 << 19


def test_auto_picks_sequence_parallelism_for_a_long_sequence_and_not_for_a_short_one() -> None:
    hw = hardware_for(8, "H100", None, 2048, None, detect=False)
    long = choose_auto("meta-llama/Llama-3.1-8B", hw, seq_len=LONG, global_batch=8, lora="never")
    c = long.inputs
    assert c.uses_long_context and long.evaluation.fits
    assert c.sp in (2, 4, 8) and 32 % c.sp == 0 and 8 % c.sp == 0 and LONG % c.sp == 0
    assert c.lora_rank is None  # exact techniques before LoRA
    assert any("needs DeepSpeed ALST" in r for r in long.reasons)
    # Nothing without ALST fits at 512k: it is chosen because it must be.
    without = inputs(seq_len=LONG, zero_stage=3, offload_optimizer="cpu", offload_params="cpu")
    assert not evaluate(without, hw).fits
    short = choose_auto("meta-llama/Llama-3.1-8B", hw, seq_len=4096, global_batch=64)
    assert not short.inputs.uses_long_context and short.inputs.sp == 1


def test_auto_recipe_for_a_long_sequence_names_sp_and_the_switches(tmp_path: Path) -> None:
    path = tmp_path / "auto.yaml"
    argv = ["plan", "--recipe", "auto", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "8", "--gpu", "H100"]
    assert (
        cli.main(
            [*argv, "--host-ram", "2048", "--seq-len", str(LONG), "--global-batch", "8", "--write", str(path)]
        )
        == 0
    )
    recipe = load_recipe(str(path))
    assert recipe.deepspeed.sequence_parallel > 1 and recipe.data.packing == "padded"
    assert recipe.data.seq_len == LONG
    from llm_train.train import main as train_main

    tokenizer = "model.tokenizer=llm_train/assets/tiny/tokenizer"
    assert train_main(["--recipe", str(path), "--dry-run", tokenizer]) == 0


def test_plan_fixes_a_long_sequence_with_alst_as_the_same_training() -> None:
    report = plan_recipe(
        "8b-128k-sp8", ["deepspeed.sequence_parallel=1"], gpus=8, gpu="H100", host_ram_gib=128, detect=False
    )
    assert not report.fits and report.fixes
    first = report.fixes[0]
    assert not first.changes_training and first.evaluation.fits
    assert first.kinds & {"sequence_parallel", "tiled_loss", "tiled_mlp", "offload_checkpoints"}
    sp_fix = next(f for f in report.fixes if "sequence_parallel" in f.kinds)
    assert any(o.startswith("deepspeed.sequence_parallel=") for o in sp_fix.overrides)
    # The recipe pads its rows already: no packing change is needed under SP.
    assert "data.packing=padded" not in sp_fix.overrides


def test_plan_does_not_offer_alst_for_a_short_sequence() -> None:
    # 7b-zero3 at 4k tokens without checkpointing does not fit 40 GB cards; checkpointing or a
    # smaller micro-batch does, so no ALST technique is among the fixes.
    report = plan_recipe(
        "7b-zero3",
        ["memory.activation_checkpointing=false"],
        gpus=8,
        gpu="A100-40GB",
        host_ram_gib=512,
        detect=False,
    )
    assert not report.fits and report.fixes
    alst = {"sequence_parallel", "tiled_loss", "tiled_mlp", "offload_checkpoints"}
    assert all(not (f.kinds & alst) for f in report.fixes)
    assert any(f.kinds == {"checkpointing"} for f in report.fixes)


def test_a_switch_that_changes_nothing_at_this_length_is_not_counted() -> None:
    # A row of at most hidden_size tokens is one MLP tile: the runtime runs it untiled.
    short = inputs(seq_len=4096)
    assert gpu(short.vary(tiled_mlp=True)) == gpu(short)
    # Beyond it, the one recomputed layer keeps one tile (and its gradients) instead of the whole row's.
    longer = inputs(seq_len=16384)
    assert (
        gpu(longer)["activations"] - gpu(longer.vary(tiled_mlp=True))["activations"]
        == (16384 - 2 * H) * 8 * INTER
    )


# --- docs/long-context.md's table -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def table() -> list:  # type: ignore[type-arg]
    return long_context_table()


def test_longest_sequence_grows_with_gpu_count_and_with_alst(table: list) -> None:  # type: ignore[type-arg]
    h100 = [(plain, alst) for plain, alst in table if alst.hardware.name == "H100"]
    assert [alst.hardware.gpus for _, alst in h100] == [1, 2, 4, 8]
    lengths = [alst.seq_len for _, alst in h100]
    assert lengths == sorted(lengths) and lengths[-1] > lengths[0]
    for plain, alst in table:
        assert alst.seq_len > plain.seq_len > 0
    # The 1M recipe's node is in the table: 8 x H100 fits at least 1M tokens with ALST.
    assert h100[-1][1].seq_len >= 1 << 20


def test_each_longest_sequence_is_the_boundary(table: list) -> None:  # type: ignore[type-arg]
    for plain, alst in table:
        for fit in (plain, alst):
            shape, hw = LLAMA31_8B, fit.hardware
            assert fit.evaluation is not None and fit.evaluation.fits
            assert best_fit(shape, hw, fit.seq_len + SEQ_STEP, fit.alst) is None


def test_the_long_context_page_shows_the_table_the_code_prints(table: list) -> None:  # type: ignore[type-arg]
    page = (RECIPES_DIR.parent / "docs" / "long-context.md").read_text()
    assert render_table("meta-llama/Llama-3.1-8B", table) in page


# --- the recipes ------------------------------------------------------------------------------------------


def test_the_1m_recipe_header_states_the_planners_verdict() -> None:
    header = " ".join(
        line.lstrip("# ")
        for line in (RECIPES_DIR / "8b-1m-sp8-alst.yaml").read_text().splitlines()
        if line[:1] == "#"
    )
    match = re.search(r"FITS: GPU ([\d.]+) of [\d.]+ GiB per GPU, host RAM (\d+) of (\d+) GiB", header)
    assert match, "the header must state the planner's verdict"
    report = plan_recipe(
        "8b-1m-sp8-alst", [], gpus=8, gpu="H100", host_ram_gib=float(match.group(3)), detect=False
    )
    assert report.word == "FITS"
    assert abs(report.evaluation.device_bytes / GiB - float(match.group(1))) < 0.1
    assert abs(report.evaluation.host_bytes / GiB - float(match.group(2))) < 1.0
    c = report.evaluation.inputs
    assert c.long_context == (8, True, True, True) and c.seq_len == 1 << 20


def test_the_long_context_recipes_are_laid_out_as_their_names_say() -> None:
    for name, sp, seq in (
        ("8b-128k-sp8", 8, 131072),
        ("8b-1m-sp8-alst", 8, 1 << 20),
        ("8b-32k-rtx4090", 1, 32768),
    ):
        recipe = load_recipe(name)
        assert recipe.model.name_or_path == "meta-llama/Llama-3.1-8B"
        assert (recipe.deepspeed.sequence_parallel, recipe.data.seq_len) == (sp, seq), name
        assert recipe.deepspeed.config.startswith("zero3")
        if sp > 1 and recipe.data.packing == "packed":
            assert recipe.memory.attention == "flash_attention_2", name


def test_the_64k_qlora_recipe_fits_one_24gb_card_as_its_header_says() -> None:
    """8b-qlora-64k-rtx4090: QLoRA at >= 64k tokens on one 24 GB card with the chunked loss and the ALST
    switches; its header quotes the planner's GPU, host RAM and tokens/s."""
    recipe = load_recipe("8b-qlora-64k-rtx4090")
    assert recipe.lora is not None and recipe.lora.quantize == "nf4" and recipe.data.seq_len >= 65536
    assert (recipe.hardware.processes_per_node, recipe.hardware.gpu_mem_gib) == (1, 24)
    memory = recipe.memory
    assert (
        memory.tiled_loss
        and memory.tiled_mlp
        and memory.offload_checkpoints
        and memory.activation_checkpointing
    )
    header = " ".join(
        line.lstrip("# ")
        for line in (RECIPES_DIR / "8b-qlora-64k-rtx4090.yaml").read_text().splitlines()
        if line[:1] == "#"
    )
    match = re.search(r"GPU ~([\d.]+) GiB, host RAM ~([\d.]+) GiB .* FITS, at ~(\d+) tokens/s", header)
    assert match, "the header must quote the planner"
    # With flash-attn, which auto takes where it is installed (the header asks for it on a 4090).
    report = plan_recipe("8b-qlora-64k-rtx4090", ["memory.attention=flash_attention_2"], detect=False)
    assert report.word == "FITS"
    assert abs(report.evaluation.device_bytes / GiB - float(match.group(1))) < 0.05
    assert abs(report.evaluation.host_bytes / GiB - float(match.group(2))) < 0.05
    assert abs(report.evaluation.time.tokens_per_s - float(match.group(3))) < 1
    # 131k does not fit the card any more (the header says so): the estimate an earlier planner gave
    # (21.8 GiB) did not count the norms' fp32 copies nor the loss's real chunk.
    longer = plan_recipe(
        "8b-qlora-64k-rtx4090",
        ["data.seq_len=131072", "memory.attention=flash_attention_2"],
        host_ram_gib=64,
        detect=False,
    )
    assert longer.evaluation.device_bytes > 24 * GiB
    # Without flash-attn, auto takes sdpa on the 4090 (flex's backward does not fit its shared memory at
    # head_dim 128), and the [64k x 64k] mask of packed rows does not fit: the header says that too.
    if not Installed.here().flash_attn:
        plain = plan_recipe("8b-qlora-64k-rtx4090", [], detect=False)
        assert plain.evaluation.inputs.attn_impl == "sdpa" and plain.word == "DOES NOT FIT"
        (quoted,) = re.findall(r"mask for packed rows does not fit \(GPU ~([\d.]+) GiB\)", header)
        assert abs(plain.evaluation.device_bytes / GiB - float(quoted)) < 0.05
