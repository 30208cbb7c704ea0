"""A LoRA run's final/ written layer by layer: the host never holds more than one shard of the model.

The plain way to export (gather the whole 16-bit state dict on rank 0's host, fold the adapters
into new tensors, save) holds two full copies of the model in host RAM: 30 GiB for an 8B model,
more than a 32 GiB desktop can spare at the end of a run. Here each module's weights are
gathered on the GPU (under ZeRO-3 a `GatheredParameters` context of that module alone; without
it they are already whole on every rank), the adapter is folded in on the GPU (4-bit bases are
dequantised there first), and only the result moves to the host, into the shard being filled;
a full shard is written and freed before the next one starts. Host peak: one shard
(`MAX_SHARD_BYTES`) plus the tensor in flight.

The directory is what `save_pretrained` writes: `model.safetensors` (one shard) or
`model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`, `config.json` without
the quantisation section (the merged weights are plain 16-bit), the generation config and the
tokenizer. `runtime/export/verify.py` verifies it like any other export.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from llm_train.planning.memory.formulas import EXPORT_SHARD_BYTES
from llm_train.runtime.export.names import renamer
from llm_train.runtime.model.quantized_base import dequantized_weight, is_quantized_linear

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

# 2 GiB: large enough that an 8B model is 8 files, small enough for a 16 GiB desktop's budget
# (the planner counts the same constant as the export's host peak).
MAX_SHARD_BYTES = EXPORT_SHARD_BYTES

# A context that makes these parameters whole on every rank for its duration (ZeRO-3:
# deepspeed.zero.GatheredParameters); every rank enters it for the same module in the same order.
Gather = Callable[[list[torch.nn.Parameter]], contextlib.AbstractContextManager[Any]]


def no_gather(params: list[torch.nn.Parameter]) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


def _is_lora_layer(module: torch.nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def _own_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's own parameters and persistent buffers (what its state_dict holds at this level)."""
    for name, param in module.named_parameters(recurse=False):
        yield name, param
    for name, buffer in module.named_buffers(recurse=False):
        if buffer is not None and name not in module._non_persistent_buffers_set:
            yield name, buffer


def merged_tensors(
    peft_model: PeftModel, gather: Gather, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name as the plain model calls it, tensor on the compute device) for every tensor of the merged model.

    Every rank runs this generator to the end (the gathers are collectives); the tensors it yields
    are whole on every rank. A tied weight (the same Parameter under two names) comes once, under
    the first name, as save_pretrained stores it.
    """
    base = peft_model.get_base_model()
    adapter = peft_model.active_adapter
    seen: set[int] = set()
    skip_under: str | None = None
    for path, module in base.named_modules():
        if skip_under is not None and path.startswith(skip_under):
            continue  # inside a LoRA layer: its base layer and adapters were handled with it
        skip_under = None
        prefix = f"{path}." if path else ""
        if _is_lora_layer(module):
            skip_under = prefix
            layer = module.base_layer
            with gather(list(module.parameters())):
                weight = dequantized_weight(layer, dtype) if is_quantized_linear(layer) else layer.weight
                # PEFT's own delta (B @ A x scaling, transposed where the layer stores fan_in x fan_out).
                merged = weight.to(torch.float32) + module.get_delta_weight(adapter).to(torch.float32)
                yield f"{prefix}weight", merged.to(dtype)
                if getattr(layer, "bias", None) is not None:
                    yield f"{prefix}bias", layer.bias.detach()
            continue
        own = [(n, t) for n, t in _own_tensors(module) if id(t) not in seen]
        if not own:
            continue
        seen.update(id(t) for _, t in own)
        params = [t for _, t in own if isinstance(t, torch.nn.Parameter)]
        with gather(params):
            for name, tensor in own:
                yield f"{prefix}{name}", tensor.detach()


class ShardedWriter:
    """safetensors shards of at most `max_bytes`, named and indexed as save_pretrained names them."""

    def __init__(self, out_dir: Path, max_bytes: int = MAX_SHARD_BYTES) -> None:
        self.out_dir, self.max_bytes = Path(out_dir), max_bytes
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0
        self.peak_pending_bytes = 0  # the host's share of the export: the largest shard held at once

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self._pending_bytes += size
        self.total_bytes += size
        self.peak_pending_bytes = max(self.peak_pending_bytes, self._pending_bytes)

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out_dir / f".part-{len(self._files):05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._files.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, give every file its final name, and the index when there are several."""
        if self._pending or not self._files:
            self._flush()
        count = len(self._files)
        if count == 1:
            final = [self.out_dir / "model.safetensors"]
        else:
            final = [self.out_dir / f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map = {}
        for (tmp, names), path in zip(self._files, final, strict=True):
            os.replace(tmp, path)
            weight_map.update({name: path.name for name in names})
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return final


def plain_config(config: PretrainedConfig) -> PretrainedConfig:
    """The model's config as a 16-bit export needs it: no quantisation section, no pre-quantisation dtype."""
    clean = copy.deepcopy(config)
    for key in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(clean, key):
            delattr(clean, key)
    return clean


def write_merged(
    peft_model: PeftModel,
    out_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    gather: Gather,
    dtype: torch.dtype,
    write: bool,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> int:
    """Write final/ as a plain HF model with the adapters folded in; returns the host peak in bytes.

    Every rank calls this (the gathers are collectives); only the rank with `write` keeps tensors
    and touches the disk.
    """
    from transformers import GenerationConfig

    writer = ShardedWriter(out_dir, max_shard_bytes) if write else None
    # Under the names save_pretrained gives the plain model (an image-text model's hub layout: names.py).
    rename = renamer(cast("PreTrainedModel", peft_model.get_base_model()))
    for name, tensor in merged_tensors(peft_model, gather, dtype):
        if writer is not None:
            writer.add(rename(name), tensor)
    if writer is None:
        return 0
    writer.close()
    base = cast(
        "PreTrainedModel", peft_model.get_base_model()
    )  # PEFT annotates a Module; ours wraps transformers'
    config = plain_config(base.config)
    config.dtype = dtype  # what the files hold (the base may have been loaded in another dtype)
    config.save_pretrained(out_dir)
    with contextlib.suppress(ValueError):  # a config without generation fields: nothing to write
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return writer.peak_pending_bytes


def adapter_state(peft_model: PeftModel, gather: Gather) -> dict[str, torch.Tensor]:
    """The trainable (adapter) tensors, whole and on the host, under the PEFT model's own names."""
    named = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
    with gather([p for _, p in named]):
        return {n: p.detach().to("cpu", copy=True) for n, p in named}


def write_adapter(
    peft_model: PeftModel, out_dir: Path, tokenizer: PreTrainedTokenizerBase, gather: Gather, write: bool
) -> None:
    """final/ as PEFT's adapter files (adapter_config.json, adapter_model.safetensors) and the tokenizer."""
    state = adapter_state(peft_model, gather)
    if write:
        peft_model.save_pretrained(str(out_dir), state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
