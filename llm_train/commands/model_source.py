"""Which model `llm-train eval | generate | chat` run: an export, a run directory or a checkpoint, loaded.

    an export (a Hugging Face model directory, or PEFT adapter files)   used as it is
    a run directory                                                    its final/, else its newest checkpoint
    a checkpoint (RUN_DIR/checkpoints/step-N)                          exported first, into RUN_DIR/exports/step-N

A checkpoint goes through `llm-train export`'s own verified export (runtime/export/from_checkpoint.py
`export_checkpoint`: keys and logits against the training engine's), never a second conversion
path; the export is kept and reused. A run's own `config/recipe.yaml` supplies what the export
alone does not say: the chat template the run trained with (`data.chat_template`) and, for an
adapter export, whether the base was quantised (`lora.quantize`: loaded in 4 or 8 bits again when
bitsandbytes imports).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_train.commands.convert import checkpoint_of
from llm_train.config.model_kind import is_image_text
from llm_train.config.recipe import Recipe, load_recipe
from llm_train.config.recipe_sections import LoraSection
from llm_train.data.formats.messages import chat_template_for
from llm_train.errors import UserError, first_line
from llm_train.runtime.export.from_checkpoint import export_checkpoint
from llm_train.runtime.export.write import EXPORT_DTYPES
from llm_train.runtime.model.lora import is_adapter_export
from llm_train.runtime.model.quantized_base import quantization_config
from llm_train.units import GiB

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EXPORTS = "exports"  # RUN_DIR/exports/step-N: checkpoints exported for eval / generate


@dataclass(frozen=True)
class ModelSource:
    """A model to run, and the run it comes from (None: a bare export)."""

    model_dir: Path
    run_dir: Path | None
    step: int | None  # the optimizer step the weights are from, when known
    recipe: Recipe | None  # the run's config/recipe.yaml

    @property
    def adapter(self) -> bool:
        return is_adapter_export(self.model_dir)


def resolve_source(path: Path, say: Callable[[str], None] = print) -> ModelSource:
    """The model `path` names (an export, a run directory, a checkpoint), a checkpoint exported first."""
    if not path.is_dir():
        raise UserError(f"{path}: not a directory; give a run directory, a checkpoint or an exported model")
    if _is_export(path):
        run_dir = path.parent if _is_run_dir(path.parent) else None
        step = _last_step(run_dir) if run_dir is not None and path.name == "final" else None
        if run_dir is not None and path.parent.name == EXPORTS:  # RUN_DIR/exports/step-N
            run_dir = path.parent.parent
            step = _step_of(path.name)
        return ModelSource(path, run_dir, step, _recipe(run_dir))
    if _is_run_dir(path) and _is_export(path / "final"):
        return ModelSource(path / "final", path, _last_step(path), _recipe(path))
    if (path / "manifest.json").is_file() or (path / "checkpoints").is_dir():
        return _exported_checkpoint(path, say)
    raise UserError(
        f"{path}: neither an exported model (config.json or adapter_config.json), a run directory (final/ or "
        "checkpoints/) nor a checkpoint (checkpoints/step-N)"
    )


def _exported_checkpoint(path: Path, say: Callable[[str], None]) -> ModelSource:
    ckpt = checkpoint_of(path, "eval")
    run_dir = ckpt.parent.parent  # RUN_DIR/checkpoints/step-N
    out = run_dir / EXPORTS / ckpt.name
    if not (out / "export_check.json").is_file():  # written last by the verified export
        if out.exists():
            import shutil

            shutil.rmtree(out)  # an export that did not finish
        result = export_checkpoint(ckpt, out, "fp32")
        say(f"exported {ckpt} -> {out}: {result['tensors']} tensors, {result['dtype']}; {result['verified']}")
    return ModelSource(out, run_dir, _step_of(ckpt.name), _recipe(run_dir))


def _is_export(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / "adapter_config.json").is_file()


def _is_run_dir(path: Path) -> bool:
    return (path / "config" / "recipe.yaml").is_file()


def _step_of(name: str) -> int | None:
    digits = name.removeprefix("step-")
    return int(digits) if digits.isdigit() else None


def _last_step(run_dir: Path | None) -> int | None:
    """The last step the run logged: the step its final/ holds."""
    path = None if run_dir is None else run_dir / "metrics.jsonl"
    if path is None or not path.is_file():
        return None
    steps = [json.loads(line).get("step") for line in path.read_text().splitlines() if line.strip()]
    return max((s for s in steps if isinstance(s, int)), default=None)


def _recipe(run_dir: Path | None) -> Recipe | None:
    if run_dir is None:
        return None
    return load_recipe(str(run_dir / "config" / "recipe.yaml"), [])


def torch_dtype(name: str) -> Any:
    """`--dtype`: auto = bf16 on a GPU that has it, else fp32 (CPUs and older GPUs)."""
    import torch

    if name == "auto":
        return (
            torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
        )
    return EXPORT_DTYPES[name]


# Files a saved tokenizer consists of (fast, sentencepiece, byte-level BPE): without any, there is none.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    """The export's tokenizer with the chat template the run trained with (the recipe's data.chat_template)."""
    from transformers import AutoTokenizer

    model_dir = source.model_dir
    fix = "copy the tokenizer files of the model it was trained from into it, or give the run directory (its final/ has them)"
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"{model_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); {fix}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:  # transformers' words for a tokenizer it cannot build from the files
        raise UserError(f"{model_dir}: its tokenizer does not load ({first_line(exc)}); {fix}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    override = source.recipe.data.chat_template if source.recipe is not None else None
    if override:
        tokenizer.chat_template = chat_template_for(tokenizer, override, "data.chat_template")
    return tokenizer


def load_model(source: ModelSource, dtype: Any, quantize: str = "auto") -> tuple[Any, str]:
    """The model (a transformers PreTrainedModel, or PEFT's model around one) in eval mode on this
    machine's device, and one line saying how it was loaded.

    quantize: auto = an adapter export's base as the run had it (its lora.quantize) when bitsandbytes
    imports; none, nf4 or int8 = that, for the base of an adapter or for a merged model.
    """
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lora = source.recipe.lora if source.recipe is not None else None
    kind = _quantize(quantize, lora.quantize if lora is not None and source.adapter else "none")
    options: dict[str, Any] = {"dtype": dtype}
    if kind != "none":
        base_lora = (lora or LoraSection()).model_copy(update={"quantize": kind})
        options["quantization_config"] = quantization_config(base_lora, dtype)
        options["device_map"] = {"": device}
    how = f"{str(dtype).removeprefix('torch.')} on {device}" + (f", base in {kind}" if kind != "none" else "")
    model: Any
    if source.adapter:
        from peft import PeftModel

        config = json.loads((source.model_dir / "adapter_config.json").read_text())
        base_path = config.get("base_model_name_or_path")
        if not base_path:
            raise UserError(f"{source.model_dir}: adapter_config.json names no base_model_name_or_path")
        if kind == "none":
            check_host_ram(Path(base_path), dtype)
        try:
            base = model_class(Path(base_path)).from_pretrained(base_path, **options)
        except OSError as exc:
            raise UserError(
                f"{source.model_dir}: the adapter's base {base_path} does not load ({first_line(exc)}); export the run "
                "merged (lora.export=merged) or make the base available"
            ) from None
        model = PeftModel.from_pretrained(base, source.model_dir)
        how = f"PEFT adapter on {base_path}, {how}"
    else:
        if kind == "none":
            check_host_ram(source.model_dir, dtype)
        model = model_class(source.model_dir).from_pretrained(source.model_dir, **options)
    if kind == "none":
        model.to(device)
    model.eval()
    return model, how


def model_class(model_dir: Path) -> Any:
    """AutoModelForImageTextToText for an image-text model's folder (the class its config names, vision tower
    included: the causal-LM class drops or refuses them in transformers 5.25), else AutoModelForCausalLM."""
    import transformers

    path = model_dir / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return (
        transformers.AutoModelForImageTextToText
        if is_image_text(config)
        else transformers.AutoModelForCausalLM
    )


def is_image_text_dir(model_dir: Path) -> bool:
    path = model_dir / "config.json"
    return path.is_file() and is_image_text(json.loads(path.read_text()))


def host_ram_needed(model_dir: Path, dtype: Any) -> int | None:
    """Bytes the weights in model_dir's safetensors take in `dtype` (None: no local safetensors to read)."""
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        return None  # a hub id or another format: from_pretrained finds out
    return int(sum(map(safetensors_elements, files)) * dtype.itemsize)


def safetensors_elements(file: Path) -> int:
    """The number of weights a .safetensors file holds, read from its header alone.

    By hand rather than with safetensors' `safe_open`: safe_open maps the whole file, and a file larger
    than this host's memory fails there ("unable to mmap ... Cannot allocate memory", safetensors 0.8)
    before the one-line refusal could be given. The format (safetensors' README): 8 bytes, the header's
    length as a little-endian u64, then the header, JSON: each tensor's dtype, shape and offsets, and an
    optional "__metadata__".
    """
    with file.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def check_host_ram(model_dir: Path, dtype: Any) -> None:
    """Refuse in one line a model whose weights do not fit this host's free RAM in `dtype`.

    Without quantisation transformers builds the whole model on the host before it moves to a GPU (its
    weights in `dtype`: a bf16 export loaded in fp32 takes twice its files), and the OS would end the
    process mid-load with no message at all.
    """
    import psutil

    need = host_ram_needed(model_dir, dtype)
    free = int(psutil.virtual_memory().available)
    if need is None or need <= free:
        return
    name = str(dtype).removeprefix("torch.")
    smaller = " --dtype bf16 (half of fp32)," if name == "float32" else ""
    raise UserError(
        f"{model_dir}: its weights take {need / GiB:.1f} GiB of host RAM in {name} to load, this machine has "
        f"{free / GiB:.1f} GiB free; use{smaller} --quantize nf4 (4-bit weights, with bitsandbytes), or a "
        f"machine with at least {math.ceil(need / GiB)} GiB free"
    )


def _quantize(requested: str, runs: str) -> str:
    if requested != "auto":
        return requested
    if runs == "none":
        return "none"
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return "none"  # the base in full precision: the same model, more memory
    return runs
