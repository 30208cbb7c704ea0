"""Verify an exported Hugging Face model directory as a user loads it: keys, then logits.

Writing one is write.py's job, loading it as a user does load.py's, exporting from a checkpoint
from_checkpoint.py's.

The exported directory loads with `AutoModelForCausalLM.from_pretrained` (a reward model: with
`AutoModelForSequenceClassification`, see load.py `auto_class`) and no DeepSpeed.
It is verified the way a user loads it, not against llm_train's own idea of parameter
names: transformers renames some families' weights between memory and disk (GPT-NeoX's
head is `embed_out`, MoE experts are fused in memory and stored one by one) and stores tied
embeddings once, so what a complete directory holds comes from transformers itself: the
architecture config.json builds and the names save_pretrained gives it. The checks:

1. keys: the safetensors headers hold exactly the tensors (names and shapes) of the architecture
   config.json builds, named as save_pretrained names them (`check_keys`: no weight is read, so it
   runs at any size; an empty ZeRO-3 gather shows up as a tensor of shape (0,)); and where the
   model is loaded for step 2, `from_pretrained(..., output_loading_info=True)` reports no missing,
   unexpected or size-mismatched tensor either. Not `from_pretrained(device_map="meta")`: transformers
   5.25 refuses that device ("Unsupported device type 'meta'"), and a check that a release can take
   away is no check;
2. logits: the reloaded model's logits on a fixed batch equal the ones the trained model
   gave on that batch *in the training process*, before anything was written. The engines
   record that reference (runtime/checkpointing/logit_reference.py, every rank takes part in the forward) in
   RUN_DIR/export_reference.safetensors, next to final/ so final/ stays a clean HF folder.
   The tolerance comes from the precision of the two computations (`logit_tolerance`).
3. masters (checkpoints only, before any merge): each optimizer shard holds the fp32 master
   weights some rank recorded a digest of at the save (runtime/checkpointing/master_digest.py): the check a
   bf16 logit comparison cannot make at fine-tuning learning rates (from_checkpoint.py runs it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import psutil
import torch

from llm_train.errors import ExportError, first_line
from llm_train.runtime.checkpointing.logit_reference import (
    Reference,
)
from llm_train.runtime.export.load import auto_class, transformers_quiet
from llm_train.runtime.export.names import checkpoint_names

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Tolerance of the logit check, in units of the coarser dtype's machine epsilon, times the
# largest reference logit. Why the largest logit: every logit is a dot product of the final
# hidden state with one output row, so rounding anywhere upstream moves all logits by an
# amount proportional to that scale, not to each logit's own (possibly near-zero) value.
# Why 4 ulps: 16-bit weights are stored exactly, so the reloaded model differs from the
# training one only in rounding: other kernels (CPU here, GPU in training), fp32 RoPE
# frequencies where DeepSpeed cast them to bf16, each rounding half an ulp of the residual
# stream and accumulating over layers. Measured on CPU: 0 (ZeRO-3 on 2 ranks, pipeline; same
# kernels) to 0.5 ulp (RoPE buffers cast) in bf16; GPU training against a CPU reload is
# not measured here, hence the margin. A re-drawn first-block weight moved the logits of
# the unit tests' tiny random models by 14-50% of the scale, far above 4 bf16 ulps (3%);
# Gemma's random-init blocks move them only ~1% (hidden by its scaled embedding), below what
# a bf16 comparison can resolve. fp32's 4 ulps (5e-7) is below the noise of reordered
# summations, so fp32 gets a floor of 1e-4 of the scale.
_TOLERANCE_ULPS = 4
_FP32_RELATIVE_FLOOR = 1e-4
# The logit check loads the whole model on this host; above this share of the free RAM only
# the keys are checked (safetensors headers against the architecture built on the meta device).
_LOGIT_CHECK_RAM_SHARE = 0.5


@dataclass(frozen=True)
class ExportReport:
    tensors: int
    max_logit_diff: float | None = None
    tolerance: float | None = None
    why_no_logits: str | None = None

    def describe(self) -> str:
        keys = "loads with no missing, unexpected or mismatched keys"
        if self.max_logit_diff is None:
            return f"{keys}; logits not compared: {self.why_no_logits}"
        return (
            f"{keys}; logits on a fixed batch within {self.max_logit_diff:.2g} of the trained model's "
            f"(tolerance {self.tolerance:.2g})"
        )


def expected_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the architecture in model_dir/config.json (built on the meta device).

    In-memory names, for counting parameters; the export check itself does not use them.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        skeleton = auto_class(config).from_config(config)
    return {name: tuple(p.shape) for name, p in _untied(skeleton.state_dict(keep_vars=True)).items()}


def _untied(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with every tensor that aliases an earlier one (a tied weight) left out."""
    seen: set[tuple[Any, ...]] = set()
    out = {}
    for name, tensor in state_dict.items():
        # Meta tensors have no storage: the Parameter object's identity decides (keep_vars=True).
        ident = (
            (id(tensor),)
            if tensor.is_meta
            else (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        )
        if ident not in seen:
            seen.add(ident)
            out[name] = tensor
    return out


def saved_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ExportError(f"export {model_dir}: no *.safetensors files were written")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def logit_tolerance(reference_logits: torch.Tensor, *dtypes: torch.dtype) -> float:
    """Allowed max |difference| of two computations of these logits in these dtypes (see _TOLERANCE_ULPS)."""
    eps = max(torch.finfo(d).eps for d in dtypes)
    scale = max(float(reference_logits.abs().max()), 1e-6)  # all-zero logits: still a positive bound
    return scale * max(_TOLERANCE_ULPS * eps, _FP32_RELATIVE_FLOOR)


# ------------------------------------------------------------ the check


def _load(model_dir: Path) -> tuple[PreTrainedModel, dict[str, Any]]:
    from transformers import AutoConfig

    try:
        with transformers_quiet():
            auto = auto_class(AutoConfig.from_pretrained(model_dir))
            # output_loading_info=True makes it a (model, info) pair, which its annotation does not say.
            return cast(
                "tuple[PreTrainedModel, dict[str, Any]]",
                auto.from_pretrained(
                    model_dir,
                    dtype="auto",  # the dtype it was saved in, as a user gets it
                    output_loading_info=True,
                    ignore_mismatched_sizes=True,  # reported in the loading info, turned into one line below
                ),
            )
    except (OSError, ValueError, RuntimeError) as exc:
        raise ExportError(f"export {model_dir}: from_pretrained fails ({first_line(exc)})") from None


def check_loading_info(model_dir: Path, info: dict[str, Any]) -> None:
    """Raise one line unless from_pretrained found exactly the tensors the architecture needs."""
    found = {
        what: sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        for key, what in (
            ("missing_keys", MISSING),
            ("unexpected_keys", UNEXPECTED),
            ("mismatched_keys", MISSHAPED),
        )
    }
    _refuse(model_dir, "from_pretrained finds", found)
    if info.get("error_msgs"):
        raise ExportError(f"export {model_dir}: from_pretrained reports {info['error_msgs'][0]}")


MISSING, UNEXPECTED = "missing", "unexpected"
MISSHAPED = "of the wrong shape (empty: a ZeRO-3 gather failed?)"


def _refuse(model_dir: Path, finder: str, found: dict[str, list[str]]) -> None:
    """One line for the first kind of problem found (missing, unexpected, mis-shaped), if any."""
    for what, keys in found.items():
        if keys:
            raise ExportError(
                f"export {model_dir}: {finder} {len(keys)} tensors {what}, e.g. {keys[0]}; "
                "the directory is not a complete model"
            )


@dataclass(frozen=True)
class _Needed:
    """A tensor the architecture in config.json needs: every name a load takes it under, and its shape."""

    names: tuple[str, ...]  # the first is the name save_pretrained writes
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Architecture:
    """What a complete directory of the architecture in config.json holds, from a skeleton on the meta device."""

    plain: list[
        _Needed
    ]  # stored as they are in memory (under another name at most, e.g. GPT-NeoX's embed_out)
    # Tensors save_pretrained converts (a fused MoE expert tensor is written one expert at a time): the
    # directory holds either the written form or, complete, the in-memory one.
    converted: list[_Needed]
    in_memory: list[_Needed]
    may_lack: tuple[str, ...]  # the model class's patterns for keys a load does not miss
    may_hold: tuple[str, ...]  # ... and for stored keys a load ignores


def _architecture(model_dir: Path) -> _Architecture:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"), transformers_quiet():  # no memory, no initialisation
            skeleton = auto_class(config).from_config(config)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ExportError(
            f"export {model_dir}: config.json does not build a model ({first_line(exc)})"
        ) from None
    # save_pretrained's steps in its order: drop the keys it never saves, store a tied tensor once (a
    # tied pair is one Parameter), then rename / convert to the checkpoint's names.
    state = skeleton.state_dict(keep_vars=True)
    for key in skeleton._keys_to_ignore_on_save or ():
        state.pop(key, None)
    memory_names: dict[int, list[str]] = {}
    for name, tensor in state.items():
        memory_names.setdefault(id(tensor), []).append(name)
    stored = _saved_form(model_dir, skeleton, state)
    # A renamed tensor is the same object under its stored name; a converted one is a new tensor.
    stored_names: dict[int, list[str]] = {}
    for name, tensor in stored.items():
        stored_names.setdefault(id(tensor), []).append(name)
    plain, in_memory = [], []
    for ident, names in memory_names.items():
        shape = tuple(state[names[0]].shape)
        if ident in stored_names:
            plain.append(
                _Needed((*stored_names[ident], *(n for n in names if n not in stored_names[ident])), shape)
            )
        else:
            in_memory.append(_Needed(tuple(names), shape))
    converted = [
        _Needed(tuple(names), tuple(stored[names[0]].shape))
        for ident, names in stored_names.items()
        if ident not in memory_names
    ]
    return _Architecture(
        plain,
        converted,
        in_memory,
        tuple(skeleton._keys_to_ignore_on_load_missing or ()),
        tuple(skeleton._keys_to_ignore_on_load_unexpected or ()),
    )


def _saved_form(
    model_dir: Path, skeleton: PreTrainedModel, state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`state` under the names (and in the layout) save_pretrained writes it.

    transformers 5.x renames and converts some families' weights between memory and disk (GPT-NeoX's head is
    lm_head in memory and embed_out on disk; MoE experts are fused in memory) with the function below, the one
    save_pretrained calls (modeling_utils.py, 5.24 and 5.25). It is not public API: where it is gone the check
    refuses in one line rather than compare names that may no longer be the stored ones.
    """
    try:
        from transformers.core_model_loading import revert_weight_conversion  # noqa: F401 (names.py calls it)
    except ImportError:
        import transformers

        raise ExportError(
            f"export {model_dir}: transformers {transformers.__version__} has no "
            "core_model_loading.revert_weight_conversion (save_pretrained's key names; verified on 5.24-5.25), "
            "so the keys cannot be checked: install the tested transformers"
        ) from None
    return checkpoint_names(skeleton, state)


def check_keys(model_dir: Path, saved: dict[str, tuple[int, ...]]) -> None:
    """Raise one line unless the safetensors headers hold exactly the tensors config.json's architecture needs.

    Names and shapes only: the architecture is built on the meta device and no weight is read, so this
    runs whatever the model's size. It follows from_pretrained's rules: a tied tensor is stored under
    either of its names, and the model class's ignore patterns excuse a key (what it loads it reports).
    """
    arch = _architecture(model_dir)

    def matches(patterns: tuple[str, ...], key: str) -> bool:
        return any(re.search(pattern, key) for pattern in patterns)

    def absent(tensors: list[_Needed]) -> list[str]:
        return [
            t.names[0]
            for t in tensors
            if not any(n in saved for n in t.names) and not any(matches(arch.may_lack, n) for n in t.names)
        ]

    everything = [*arch.plain, *arch.converted, *arch.in_memory]
    known = {name for t in everything for name in t.names}
    found = {
        MISSING: sorted(absent(arch.plain) + (absent(arch.converted) if absent(arch.in_memory) else [])),
        UNEXPECTED: sorted(k for k in saved if k not in known and not matches(arch.may_hold, k)),
        MISSHAPED: sorted(n for t in everything for n in t.names if n in saved and saved[n] != t.shape),
    }
    _refuse(model_dir, "checked against config.json's architecture, the safetensors files have", found)


def _why_not_logits(model_dir: Path, reference: Reference | None, why_none: str) -> str | None:
    if reference is None:
        return why_none
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    free = int(psutil.virtual_memory().available)
    if size > _LOGIT_CHECK_RAM_SHARE * free:
        return f"the model ({size / 2**30:.1f} GiB) is too large to load here ({free / 2**30:.1f} GiB free)"
    return None


def verify_export(
    model_dir: Path, reference: Reference | None = None, why_none: str = "no reference forward was recorded"
) -> ExportReport:
    """Check model_dir as a user loads it; raise a one-line ExportError when it is not the trained model.

    Without a reference (or when the model is too large for this host's free RAM) only the
    keys are checked, and the report says why.
    """
    model_dir = Path(model_dir)
    saved = saved_shapes(model_dir)
    empty = sorted(name for name, shape in saved.items() if 0 in shape)
    if empty:
        raise ExportError(
            f"export {model_dir}: {len(empty)} tensors are empty, e.g. {empty[0]} (a ZeRO-3 gather failed?)"
        )
    check_keys(model_dir, saved)  # headers only: whatever the size, and before anything is loaded
    why_no_logits = _why_not_logits(model_dir, reference, why_none)
    if why_no_logits is not None:
        return ExportReport(tensors=len(saved), why_no_logits=why_no_logits)
    assert reference is not None
    model, info = _load(model_dir)
    check_loading_info(model_dir, info)  # the same question, answered by the loader a user runs
    return _compare_logits(model_dir, model, reference, len(saved))


def write_check(model_dir: Path, report: ExportReport) -> None:
    """model_dir/export_check.json: the record that this export passed, and by how much.

    Written by the producer of the export (the run, `llm-train export`) rather than by every
    call of verify_export, so a later keys-only re-check does not overwrite the logit result.
    """
    result: dict[str, Any] = {"tensors": report.tensors, "ok": True, "max_logit_diff": report.max_logit_diff}
    result |= {"tolerance": report.tolerance, "logits_not_compared": report.why_no_logits}
    (Path(model_dir) / "export_check.json").write_text(json.dumps(result))


def _compare_logits(
    model_dir: Path, model: PreTrainedModel, reference: Reference, tensors: int
) -> ExportReport:
    model.eval()  # dropout off: the reference forward ran in eval mode too
    with torch.no_grad():
        logits = model(input_ids=reference.input_ids).logits.float()
    if logits.shape != reference.logits.shape:
        raise ExportError(
            f"export {model_dir}: logits have shape {tuple(logits.shape)}, "
            f"the trained model's {tuple(reference.logits.shape)}"
        )
    if not torch.isfinite(logits).all():
        raise ExportError(f"export {model_dir}: the exported model gives non-finite logits")
    diff = float((logits - reference.logits).abs().max())
    tolerance = logit_tolerance(reference.logits, reference.dtype, model.dtype)
    if not diff <= tolerance:
        coarser = max((reference.dtype, model.dtype), key=lambda d: torch.finfo(d).eps)
        raise ExportError(
            f"export {model_dir}: logits on a fixed batch differ from the trained model's by {diff:.3g} "
            f"(allowed {tolerance:.3g} for {str(coarser).removeprefix('torch.')}); the export is not the "
            "model that was trained"
        )
    return ExportReport(tensors=tensors, max_logit_diff=diff, tolerance=tolerance)
