"""Export a plain Hugging Face model directory from an llm_train checkpoint (`llm-train export`), verified
as a run's final/ is: the masters against their digests, then keys and logits (verify.py).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from llm_train.config.model_kind import is_image_text
from llm_train.config.parallel import tensor_parallel_shards
from llm_train.config.recipe_sections import ModelSection
from llm_train.errors import ExportError, UserError, first_line
from llm_train.runtime.checkpointing.commit import CHECKPOINT_REFERENCE, DS_TAG, read_manifest, verify
from llm_train.runtime.checkpointing.logit_reference import (
    Reference,
    read_reference_file,
    reference_input_ids,
)
from llm_train.runtime.checkpointing.master_digest import DIGEST_KEY, check_master_digests
from llm_train.runtime.checkpointing.universal import ensure_universal, universal_dir, universal_state_dict
from llm_train.runtime.export.load import auto_class, transformers_quiet
from llm_train.runtime.export.names import checkpoint_names
from llm_train.runtime.export.verify import verify_export, write_check
from llm_train.runtime.export.write import EXPORT_DTYPES
from llm_train.runtime.model.lora import apply_lora, checkpoint_lora, export_adapter_checkpoint
from llm_train.runtime.model.parts import linear_paths
from llm_train.runtime.model.pipeline_names import (
    pipeline_checkpoint_state_dict,  # pipeline runs: a file per layer
)
from llm_train.runtime.model.processor_files import PROCESSOR_FILES, copy_processor_files

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def checkpoint_state_dict(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """fp32 weights of a verified llm_train checkpoint, consolidated from any ZeRO stage (no GPU needed)."""

    reason = verify(ckpt_dir)
    if reason is not None:
        # DeepSpeed's shards are pickles: never load them from a directory that does not verify.
        raise UserError(f"checkpoint {ckpt_dir}: {reason}; not loading it")
    state_dir = ckpt_dir / "state"

    pipeline_state = pipeline_checkpoint_state_dict(state_dir / DS_TAG, ckpt_dir / "hf")
    if pipeline_state is not None:
        return pipeline_state

    shards, stage = tensor_parallel_shards(state_dir / DS_TAG), read_manifest(ckpt_dir)["zero_stage"]
    if shards > 1 or universal_dir(ckpt_dir).is_dir():
        # AutoTP slices (and any checkpoint a resume has already converted): DeepSpeed's universal
        # format holds every parameter whole, merged over the tensor- and data-parallel ranks.
        if stage == 0:
            raise UserError(
                f"checkpoint {ckpt_dir} was written by a tensor-parallel run on ZeRO-0 ({shards} model shards), "
                "which DeepSpeed's universal converter cannot merge: use the run's final/ (gathered at the end "
                "of training), or train tensor-parallel runs with a ZeRO-1/2 deepspeed.config"
            )
        return universal_state_dict(ensure_universal(ckpt_dir, print))
    if stage == 0:
        model_states = state_dir / DS_TAG / "mp_rank_00_model_states.pt"
        return {
            k: v.float()
            for k, v in torch.load(model_states, map_location="cpu", weights_only=False)["module"].items()
        }
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(str(state_dir), tag=DS_TAG))


def export_checkpoint(ckpt_dir: Path, out_dir: Path, dtype: str, merge: bool = False) -> dict[str, Any]:
    """A plain HF model directory from a checkpoint, verified as a run's final/ is: keys and logits.

    The reference logits are the ones the training engine recorded in the checkpoint when it was
    saved; the tolerance covers the dtypes of that forward and of the export (`logit_tolerance`).
    A LoRA checkpoint gives its adapter, or with `merge` the base with the adapters folded in (`_merged`).
    """
    from transformers import AutoConfig, AutoTokenizer

    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"export output {out_dir} is not empty; choose a new directory")
    hf_dir = ckpt_dir / "hf"
    # Before any merge: the shards must hold the masters the ranks had (bf16 logits cannot tell a
    # one-step-stale shard at fine-tuning learning rates; master_digest.py says why).
    masters = check_master_digests(ckpt_dir, recorded_master_digests(ckpt_dir))
    state_dict = checkpoint_state_dict(ckpt_dir)
    lora = checkpoint_lora(ckpt_dir)
    config = AutoConfig.from_pretrained(hf_dir)
    if lora is not None and merge:
        reference = _merged(ckpt_dir, config, state_dict, lora)
        return _write_verified(ckpt_dir, out_dir, dtype, config, reference, masters)
    if lora is not None:
        base = json.loads((hf_dir / "config.json").read_text()).get("_name_or_path")
        count, written = export_adapter_checkpoint(
            ckpt_dir, out_dir, state_dict, lora, base, _lora_excluded(ckpt_dir, config)
        )
        AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out_dir)
        why = "a LoRA checkpoint holds the adapters, not the base: PEFT adapter files (shapes checked)"
        verified = f"{why}; {masters}"
        return {"tensors": count, "dtype": written, "max_logit_diff": float("nan"), "verified": verified}
    reference = auto_class(config).from_config(config, dtype=torch.float32)
    # A tied weight is stored once, under either of its names: missing is fine when an alias is there.
    aliases = _aliases(reference.state_dict())
    expected = reference.state_dict()
    for name in [k for k in state_dict if aliases.get(k, set()) & set(state_dict)]:
        # Stored under both names: AutoTP slices the tied output layer over the vocabulary and the
        # universal format keeps that slice; the whole tensor, under the other name, is the weight.
        if name in expected and state_dict[name].shape != expected[name].shape:
            del state_dict[name]
    missing, unexpected = reference.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if not aliases.get(k, set()) - set(missing)]
    if missing or unexpected:
        problem = sorted(missing) or sorted(unexpected)
        raise ExportError(
            f"checkpoint {ckpt_dir}: weights do not match the config ({len(problem)} tensors, e.g. {problem[0]})"
        )
    return _write_verified(ckpt_dir, out_dir, dtype, config, reference, masters)


def _merged(ckpt_dir: Path, config: PretrainedConfig, state_dict: dict[str, torch.Tensor], lora: Any) -> Any:
    """The pretrained base a LoRA checkpoint was trained from, its adapters loaded and folded in (fp32).

    A LoRA checkpoint holds the adapters, not the frozen base (checkpointing/run_state.py): the base is loaded
    again from the recipe's model.name_or_path, and the adapters are placed as the run placed them (outside
    an image-text model's frozen parts). The export check then compares the merged model's logits with the
    ones the training engine recorded, so a different base (or a quantised one, whose rounding the merge
    cannot reproduce) fails it instead of passing silently.
    """
    import yaml

    section = (yaml.safe_load((ckpt_dir / "hf" / "recipe.yaml").read_text()) or {})["model"]
    model = ModelSection(**section)
    if model.init != "pretrained" or lora.quantize != "none":
        raise UserError(
            f"export --merge: checkpoint {ckpt_dir} was trained on a "
            f"{'random' if model.init != 'pretrained' else 'quantised'} base, which cannot be loaded again "
            "exactly; export the adapter (leave out --merge) or use the run's final/"
        )
    try:
        with transformers_quiet():
            base = auto_class(config).from_pretrained(
                model.name_or_path, revision=model.revision, dtype=torch.float32, config=config
            )
    except OSError as exc:
        raise UserError(
            f"export --merge: cannot load the base {model.name_or_path} ({first_line(exc)})"
        ) from None
    image_text = is_image_text(config.to_dict())
    peft_model = apply_lora(base, lora, exclude=linear_paths(base, model.freeze) if image_text else ())
    adapters = {k: v for k, v in state_dict.items() if ".lora_A." in k or ".lora_B." in k}
    missing, unexpected = peft_model.load_state_dict(adapters, strict=False)
    absent = [k for k in missing if ".lora_A." in k or ".lora_B." in k]
    if unexpected or absent or not adapters:
        problem = (unexpected or absent or ["(no adapter tensors)"])[0]
        raise ExportError(
            f"checkpoint {ckpt_dir}: its adapters do not fit the base {model.name_or_path}: {problem}"
        )
    return peft_model.merge_and_unload()


def _lora_excluded(ckpt_dir: Path, config: PretrainedConfig) -> list[str]:
    """The linear layers a LoRA run kept adapters out of: an image-text model's frozen parts (model.py), found
    on a skeleton built on the meta device from the checkpoint's config (nothing allocated, nothing read)."""
    if not is_image_text(config.to_dict()):
        return []
    import yaml

    model = ModelSection(**(yaml.safe_load((ckpt_dir / "hf" / "recipe.yaml").read_text()) or {})["model"])
    with torch.device("meta"), transformers_quiet():
        skeleton = auto_class(config).from_config(config)
    return linear_paths(skeleton, model.freeze)


def _write_verified(
    ckpt_dir: Path, out_dir: Path, dtype: str, config: PretrainedConfig, reference: Any, masters: str
) -> dict[str, Any]:
    """Write `reference` (the checkpoint's fp32 model) in `dtype` to out_dir and verify it against the logits
    the checkpoint recorded (or, for an older checkpoint, against its own fp32 logits)."""
    from transformers import AutoTokenizer, GenerationConfig

    hf_dir = ckpt_dir / "hf"
    reference.eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    # The check's reference: the logits the training engine itself computed at save time, from its
    # live state, before any file existed (checkpointing/run_state.py Saver). It shares no code with the
    # merge above (zero_to_fp32, the universal format, a ZeRO-0 load), so a bad merge or a stale
    # shard fails the check. A checkpoint without one (older llm_train) falls back to the merged
    # weights' own fp32 logits, which checks the writing only, and the report says so.
    recorded = read_reference_file(ckpt_dir / CHECKPOINT_REFERENCE)
    if recorded is None:
        batch = reference_input_ids(tokenizer, config.get_text_config().vocab_size)
        with torch.no_grad():
            recorded = Reference(batch, reference(batch).logits, torch.float32)
        against = "the checkpoint's merged weights (it records no training-time logits)"
    else:
        against = "the logits the training engine recorded in the checkpoint"
    exported = reference.to(EXPORT_DTYPES[dtype])
    # Named as the run's final/ is (names.py): the hub layout of the family, renamed once.
    exported.save_pretrained(
        out_dir,
        state_dict=checkpoint_names(exported, exported.state_dict()),
        safe_serialization=True,
        max_shard_size="5GB",
        save_original_format=False,
    )
    tokenizer.save_pretrained(out_dir)
    copy_processor_files(sorted(p for p in hf_dir.iterdir() if p.name in PROCESSOR_FILES), out_dir)
    with contextlib.suppress(ValueError):  # a config without generation fields: nothing to write
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    report = verify_export(out_dir, recorded)
    write_check(out_dir, report)
    # Too large to load on this host: keys only, and `verified` says so (the diff is then NaN).
    diff = report.max_logit_diff if report.max_logit_diff is not None else float("nan")
    verified = report.describe() + (f", compared with {against}" if report.max_logit_diff is not None else "")
    verified += f"; {masters}"
    return {
        "tensors": report.tensors,
        "dtype": dtype,
        "max_logit_diff": diff,
        "tolerance": report.tolerance,
        "verified": verified,
    }


def recorded_master_digests(ckpt_dir: Path) -> list[str | None]:
    """The master-weight digest each rank wrote into its trainer state at the save (None: none kept)."""
    return [
        json.loads(p.read_text()).get(DIGEST_KEY) for p in sorted((ckpt_dir / "trainer").glob("rank*.json"))
    ]


def _aliases(state_dict: dict[str, torch.Tensor]) -> dict[str, set[str]]:
    """For each tied tensor's name, the other names of the same storage."""
    groups: dict[tuple[int, int], set[str]] = {}
    for name, tensor in state_dict.items():
        groups.setdefault((tensor.untyped_storage().data_ptr(), int(tensor.storage_offset())), set()).add(
            name
        )
    return {name: names - {name} for names in groups.values() if len(names) > 1 for name in names}
