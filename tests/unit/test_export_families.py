"""The export check holds for every causal-LM family transformers ships, not only Llama.

Each family is a tiny random model (hidden 64, 2 layers, the bundled tokenizer's vocabulary)
saved with `save_pretrained`, which is what the engines write. The check must pass on it,
and fail in one line when the directory is not the trained model: a tensor dropped (what a
failed gather or a name llm_train got wrong looks like to a user) or a weight changed (a
shard from the wrong rank or step). Families differ in exactly the ways that broke the old
name-based check: GPT-NeoX's head is `embed_out`, GPT-2/OPT/Falcon/Bloom/Gemma tie the head
to the embedding and store it once, GPT-2 and OPT use other prefixes and have dropout.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from llm_train.errors import ExportError
from llm_train.runtime.checkpointing.logit_reference import Reference, reference_input_ids
from llm_train.runtime.export import verify as export_module
from llm_train.runtime.export.verify import logit_tolerance, verify_export
from tests.unit.data_fixtures import TOKENIZER_DIR

COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# Family -> config fields beyond COMMON (families whose attention needs an explicit head_dim).
FAMILIES = {
    "llama": {},
    "gpt_neox": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "mistral": {},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16},
    "phi": {},
    "phi3": {},
    "olmo": {},
    "olmo2": {},
    "gpt2": {},
    "opt": {},
    "falcon": {},
    "bloom": {},
    "stablelm": {},
    "starcoder2": {},
    "granite": {},
    "cohere": {},
    "smollm3": {},
}
FIRST_BLOCK = re.compile(r"\.0\.")  # model.layers.0., transformer.h.0., gpt_neox.layers.0., ...


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)


def export(family: str, tokenizer, out: Path, dtype: torch.dtype = torch.float32) -> Reference:
    """A tiny random `family` model saved to `out`, and its logits on the reference batch (eval mode)."""
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer), **COMMON, **FAMILIES[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    input_ids = reference_input_ids(tokenizer, config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    model.save_pretrained(out)
    return Reference(input_ids, logits.float(), dtype)


def first_block_weight(out: Path) -> tuple[Path, str]:
    """(file, name) of the largest stored tensor of the first decoder block."""
    (file,) = out.glob("*.safetensors")
    tensors = load_file(file)
    name = max((k for k in tensors if FIRST_BLOCK.search(k)), key=lambda k: tensors[k].numel())
    return file, name


def changed(weight: torch.Tensor) -> torch.Tensor:
    """As if the shard came from another initialisation: same size and spread, other values."""
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(1))
    return (weight.float() + noise * weight.float().std()).to(weight.dtype)


def rewrite(file: Path, change) -> None:
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_passes_and_fails_in_one_line_once_a_tensor_is_dropped_or_changed(
    family: str, tokenizer, tmp_path: Path
) -> None:
    reference = export(family, tokenizer, tmp_path)
    report = verify_export(tmp_path, reference)
    file, name = first_block_weight(tmp_path)
    saved = load_file(file)
    assert report.tensors == len(saved)
    # Same weights, same kernels, same process: the reload reproduces the logits to fp32 noise.
    assert report.max_logit_diff is not None and report.max_logit_diff <= 1e-5
    assert report.tolerance == pytest.approx(1e-4 * float(reference.logits.abs().max()))

    rewrite(file, lambda tensors: tensors.pop(name))
    with pytest.raises(ExportError) as dropped:
        verify_export(tmp_path, reference)
    assert "\n" not in str(dropped.value) and f"missing, e.g. {name}" in str(dropped.value)

    rewrite(file, lambda tensors: tensors.update({name: changed(saved[name])}))
    with pytest.raises(ExportError, match="logits on a fixed batch differ") as different:
        verify_export(tmp_path, reference)
    assert "\n" not in str(different.value)


@pytest.mark.parametrize("family", ["gpt_neox", "gpt2", "llama"])
def test_bf16_exports_pass_and_a_changed_weight_still_fails(family: str, tokenizer, tmp_path: Path) -> None:
    # The tolerance is 4 bf16 ulps of the largest logit (export/verify.py says why); reloading bf16
    # weights into bf16 kernels on the same machine must sit well inside it, and a changed
    # first-block weight well outside. (Not gemma here: its random-init blocks move the logits
    # by ~1% of their scale, which bf16 cannot tell from rounding; trained blocks move them more.)
    reference = export(family, tokenizer, tmp_path, torch.bfloat16)
    report = verify_export(tmp_path, reference)
    tolerance = logit_tolerance(reference.logits, torch.bfloat16)
    assert report.tolerance == pytest.approx(tolerance)
    assert tolerance == pytest.approx(4 * 2**-7 * float(reference.logits.abs().max()))
    assert report.max_logit_diff is not None and report.max_logit_diff <= tolerance / 4
    file, name = first_block_weight(tmp_path)
    rewrite(file, lambda tensors: tensors.update({name: changed(tensors[name])}))
    with pytest.raises(ExportError, match="differ"):
        verify_export(tmp_path, reference)


def test_an_empty_tensor_is_named_in_one_line(tokenizer, tmp_path: Path) -> None:
    reference = export("gpt_neox", tokenizer, tmp_path)
    file, name = first_block_weight(tmp_path)
    rewrite(file, lambda tensors: tensors.update({name: torch.zeros(0)}))  # a ZeRO-3 save without the gather
    with pytest.raises(ExportError, match=f"empty, e.g. {re.escape(name)}"):
        verify_export(tmp_path, reference)


def test_an_unexpected_tensor_fails(tokenizer, tmp_path: Path) -> None:
    reference = export("qwen2", tokenizer, tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    rewrite(file, lambda tensors: tensors.update({"model.layers.7.mlp.up_proj.weight": torch.ones(2, 2)}))
    with pytest.raises(ExportError, match="unexpected, e.g. model.layers.7.mlp.up_proj.weight"):
        verify_export(tmp_path, reference)


def test_without_a_reference_only_the_keys_are_checked_and_the_report_says_why(
    tokenizer, tmp_path: Path
) -> None:
    export("gpt_neox", tokenizer, tmp_path)
    report = verify_export(tmp_path, None, why_none="pipeline runs record no reference")
    assert report.max_logit_diff is None
    assert "logits not compared: pipeline runs record no reference" in report.describe()
    file, name = first_block_weight(tmp_path)
    rewrite(file, lambda tensors: tensors.pop(name))
    with pytest.raises(ExportError, match="missing"):
        verify_export(tmp_path, None)


def test_a_model_too_large_for_free_ram_is_checked_by_keys_only(
    tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = export("gpt2", tokenizer, tmp_path)
    monkeypatch.setattr(export_module, "_LOGIT_CHECK_RAM_SHARE", 0.0)  # as if the host had no free RAM
    report = verify_export(tmp_path, reference)
    assert report.max_logit_diff is None and "too large to load here" in report.describe()


def keys_only(out: Path) -> None:
    """verify_export without a reference: the check a model too large for this host's RAM gets."""
    assert verify_export(out, None).max_logit_diff is None


@pytest.mark.parametrize("family", ["gpt_neox", "gpt2", "opt", "llama"])
def test_the_keys_only_check_loads_nothing_and_names_a_missing_or_misshaped_tensor(
    family: str, tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Renamed on disk (GPT-NeoX's embed_out), tied and stored once (GPT-2, OPT), plain (Llama).
    export(family, tokenizer, tmp_path)

    def no_loading(*args, **kwargs):
        raise AssertionError("the keys-only check loaded the model")

    # Nothing is loaded: transformers 5.25 refuses device_map="meta", and a real load is what does not fit.
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)
    keys_only(tmp_path)
    file, name = first_block_weight(tmp_path)
    saved = load_file(file)

    rewrite(file, lambda tensors: tensors.update({name: saved[name][:-1].clone()}))  # one row short
    with pytest.raises(ExportError) as misshaped:
        keys_only(tmp_path)
    assert "\n" not in str(
        misshaped.value
    ) and f"wrong shape (empty: a ZeRO-3 gather failed?), e.g. {name}" in str(misshaped.value)

    rewrite(file, lambda tensors: tensors.pop(name))
    with pytest.raises(ExportError) as missing:
        keys_only(tmp_path)
    assert "\n" not in str(missing.value) and f"1 tensors missing, e.g. {name};" in str(missing.value)

    rewrite(file, lambda tensors: tensors.update({name: saved[name], "lm_head.bias": torch.zeros(3)}))
    with pytest.raises(ExportError, match="1 tensors unexpected, e.g. lm_head.bias"):
        keys_only(tmp_path)


def test_a_head_stored_under_its_in_memory_name_passes_as_from_pretrained_takes_it(
    tokenizer, tmp_path: Path
) -> None:
    # save_pretrained writes GPT-NeoX's head as embed_out; a directory written layer by layer
    # (runtime/export/sharded.py) keeps the in-memory lm_head, which from_pretrained loads too.
    export("gpt_neox", tokenizer, tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    rewrite(file, lambda tensors: tensors.update({"lm_head.weight": tensors.pop("embed_out.weight")}))
    keys_only(tmp_path)


def test_moe_experts_pass_in_either_stored_form_and_a_missing_expert_is_named(tmp_path: Path) -> None:
    # Mixtral's experts are one fused tensor per layer in memory and one tensor per expert on disk
    # (transformers 5.x converts between them): the check reads the layout save_pretrained writes.
    config = AutoConfig.for_model("mixtral", vocab_size=96, num_local_experts=4, **COMMON)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    expert = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    assert expert in load_file(file)
    keys_only(tmp_path)

    rewrite(file, lambda tensors: tensors.pop(expert))
    with pytest.raises(ExportError, match=f"1 tensors missing, e.g. {re.escape(expert)};"):
        keys_only(tmp_path)

    # The in-memory (fused) form, as a directory written layer by layer holds it, is complete too.
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, file, metadata={"format": "pt"})
    keys_only(tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_reward_model_export_is_checked_as_a_sequence_classifier_by_keys_and_scores(
    family: str, tokenizer, tmp_path: Path
) -> None:
    """objective reward exports a *ForSequenceClassification (num_labels=1): the check builds and loads it with
    AutoModelForSequenceClassification, compares its one score per row, and names a missing score head."""
    config = AutoConfig.for_model(
        family, vocab_size=len(tokenizer), num_labels=1, **COMMON, **FAMILIES[family]
    )
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    input_ids = reference_input_ids(tokenizer, config.vocab_size)
    with torch.no_grad():
        scores = model(input_ids=input_ids).logits
    assert scores.shape == (1, 1)
    model.save_pretrained(tmp_path)
    reference = Reference(input_ids, scores.float(), torch.float32)
    report = verify_export(tmp_path, reference)
    # Same weights, same kernels, same process: fp32 noise at most.
    assert report.max_logit_diff is not None and report.max_logit_diff <= 1e-5

    (file,) = tmp_path.glob("*.safetensors")
    saved = load_file(file)
    rewrite(file, lambda tensors: tensors.update({"score.weight": changed(saved["score.weight"])}))
    with pytest.raises(ExportError, match="logits on a fixed batch differ"):
        verify_export(tmp_path, reference)
    rewrite(file, lambda tensors: tensors.pop("score.weight"))
    with pytest.raises(ExportError, match="missing, e.g. score.weight") as dropped:
        verify_export(tmp_path, reference)
    assert "\n" not in str(dropped.value)
