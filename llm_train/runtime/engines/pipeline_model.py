"""Pipeline parallelism's model side: a Llama-family HF causal LM as DeepSpeed `PipelineModule` stages.

The engine that runs it is runtime/engines/pipeline_engine.py. The model is expressed as a flat
list of pipeline layers that pass plain tensors:

    embedding                      input_ids            -> (hidden, position_ids)
    decoder layer i (+ its RoPE)   (hidden, position_ids) -> (hidden, position_ids)   x L
    final norm                     (hidden, position_ids) -> hidden
    LM head (or the tied embedding) hidden               -> logits
    (memory.tiled_loss: the head runs inside the loss, in chunks: `chunk_the_loss`)

DeepSpeed partitions the list over stages by parameter count, runs micro-batches
(= gradient accumulation steps) through a 1F1B schedule in `engine.train_batch`, and
recomputes activations every `activation_checkpoint_interval` layers when the recipe asks.
Only ZeRO-0/1 are allowed (DeepSpeed refuses ZeRO-2/3 with pipelines); config/parallel.py checks that
before anything loads. Each stage builds and loads only its own layers from the HF
safetensors, and the export writes one safetensors shard per stage plus the HF index, so
no rank ever holds the whole model (except `init: random`, see `_full_random_state`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llm_train.config.model_families import MODEL_FAMILIES
from llm_train.config.resolution import Resolved
from llm_train.errors import UserError
from llm_train.planning.memory.formulas import loss_chunks
from llm_train.runtime.base import collectives
from llm_train.runtime.loss.language_modeling import ChunkedCausalLMLoss, causal_lm_loss
from llm_train.runtime.model.model import model_config
from llm_train.runtime.model.pipeline_names import TIED_KEY, LayerMap

if TYPE_CHECKING:
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

# ---------------------------------------------------------------- the pipeline layers


def _hf_classes(model_type: str) -> tuple[type, type, type]:
    """(DecoderLayer, RotaryEmbedding, RMSNorm) of one supported architecture."""
    prefix = MODEL_FAMILIES[model_type].pipeline  # config/model_families.py; parallel.py refused the others
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return (
        getattr(module, f"{prefix}DecoderLayer"),
        getattr(module, f"{prefix}RotaryEmbedding"),
        getattr(module, f"{prefix}RMSNorm"),
    )


class EmbeddingPipe(nn.Module):
    """Token embedding; passes the position ids (which mark packed samples) on to every layer."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, position_ids = inputs
        return self.embed_tokens(input_ids), position_ids


def tied_head(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head of a model with tied embeddings: the embedding matrix, transposed."""
    return nn.functional.linear(hidden, embedding.embed_tokens.weight)


def attention_mask(
    position_ids: torch.Tensor, window: int | None, dtype: torch.dtype, eager: bool
) -> torch.Tensor | None:
    """The mask transformers would build for these positions, or None where attention is plainly causal.

    Packed rows restart their position ids at every sample; like transformers' masking
    utilities, a sample attends only to itself (block-diagonal causal). Right-padded rows
    need nothing more: under a causal mask no real token sees the padding after it.
    """
    seq = position_ids.shape[1]
    plain = bool((position_ids == torch.arange(seq, device=position_ids.device)).all())
    if plain and not eager and (window is None or seq <= window):
        return None  # SDPA / FlashAttention run causal without a mask (transformers does the same)
    # Sample ids: a new sample wherever the position does not follow on by one.
    first = position_ids[:, :1] - 1
    sample = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    i = torch.arange(seq, device=position_ids.device)
    allowed = (i[None, :, None] >= i[None, None, :]) & (sample[:, :, None] == sample[:, None, :])
    if window is not None:
        allowed &= (i[:, None] - i[None, :] < window)[None]  # transformers' sliding-window rule
    mask = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


class DecoderPipe(nn.Module):
    """One HF decoder layer with its own rotary embedding (RoPE holds no weights, so each stage can)."""

    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        decoder_cls, rotary_cls, _ = _hf_classes(config.model_type)
        self.layer = decoder_cls(config, layer_idx)
        self.rotary = rotary_cls(config=config)
        self.window = _sliding_window(config, layer_idx)
        # SDPA / FlashAttention are causal without a mask; eager attention needs one spelled out.
        self.eager = config._attn_implementation == "eager"
        self.flash = config._attn_implementation.startswith("flash")

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, position_ids = inputs
        # FlashAttention-2 reads packed samples from position_ids itself (varlen kernels).
        mask = None if self.flash else attention_mask(position_ids, self.window, hidden.dtype, self.eager)
        hidden = self.layer(
            hidden,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=self.rotary(hidden, position_ids),
        )
        return hidden, position_ids


class NormPipe(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        _, _, norm_cls = _hf_classes(config.model_type)
        self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.norm(inputs[0])


class HeadPipe(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def _sliding_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if MODEL_FAMILIES[config.model_type].window_every_layer or layer_types is None:
        return int(window)  # Mistral: every layer is windowed when sliding_window is set
    return int(window) if layer_types[layer_idx] == "sliding_attention" else None


def _hidden(hidden: torch.Tensor) -> torch.Tensor:
    """The last stage's output layer under the chunked loss: the hidden states pass to the loss as they are."""
    return hidden


def chunk_the_loss(module: PipelineModule, config: PretrainedConfig, tokens: int) -> None:
    """On the last stage, move the output layer from the layers into the loss (ChunkedCausalLMLoss).

    Its parameters stay where DeepSpeed registered them (the module or the tied embedding), so the
    optimizer, the tied-weight all-reduce and checkpoints see nothing different.
    """
    if module.stage_id != module.num_stages - 1:
        return
    head = module.forward_funcs[-1]
    owner = head.args[0] if isinstance(head, partial) else head  # the tied embedding, or HeadPipe
    chunks = loss_chunks(tokens, config.vocab_size)
    module.forward_funcs[-1] = _hidden
    module.loss_fn = ChunkedCausalLMLoss(head, list(owner.parameters()), chunks)


def layer_specs(config: PretrainedConfig) -> list[Any]:
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    tied = bool(getattr(config, "tie_word_embeddings", False))
    embed = (
        TiedLayerSpec(TIED_KEY, EmbeddingPipe, config, tied_weight_attr=["embed_tokens.weight"])
        if tied
        else LayerSpec(EmbeddingPipe, config)
    )
    head = (
        TiedLayerSpec(
            TIED_KEY, EmbeddingPipe, config, forward_fn=tied_head, tied_weight_attr=["embed_tokens.weight"]
        )
        if tied
        else LayerSpec(HeadPipe, config)
    )
    decoders = [LayerSpec(DecoderPipe, config, i) for i in range(config.num_hidden_layers)]
    return [embed, *decoders, LayerSpec(NormPipe, config), head]


def build_pipeline_module(
    config: PretrainedConfig, stages: int, checkpoint_interval: int, loss_tokens: int | None = None
) -> PipelineModule:
    """This rank's stage of the model; `loss_tokens` (micro-batch rows x seq_len): the chunked loss on them."""
    from deepspeed.pipe import PipelineModule

    class HFPipelineModule(PipelineModule):
        def _count_layer_params(self) -> list[int]:
            # DeepSpeed builds every layer of the whole model once just to count its parameters
            # (minutes of random init for a 70B model); on the meta device it costs nothing.
            with torch.device("meta"):
                return super()._count_layer_params()

    module = HFPipelineModule(
        layers=layer_specs(config),
        num_stages=stages,
        loss_fn=causal_lm_loss,
        partition_method="parameters",
        activation_checkpoint_interval=checkpoint_interval,
        # Non-reentrant: works with the integer position ids passed along, and on every device.
        activation_checkpoint_func=partial(torch.utils.checkpoint.checkpoint, use_reentrant=False),
        checkpointable_layers=["DecoderPipe"],
    )
    module.config = config  # checkpoints save it next to the engine state (checkpointing/run_state.py Saver)
    if loss_tokens is not None:
        chunk_the_loss(module, config, loss_tokens)
    return module


# ---------------------------------------------------------------- weights in and out


def hf_config(run: Resolved) -> PretrainedConfig:
    config = model_config(run.recipe.model)
    config._attn_implementation = run.recipe.memory.attention
    config.use_cache = False
    return config


def _weight_files(run: Resolved) -> list[Path]:
    """The safetensors files of a pretrained model (a local directory or a hub snapshot)."""
    model = run.recipe.model
    assert model.name_or_path is not None
    directory = Path(model.name_or_path)
    if not directory.is_dir():
        from huggingface_hub import snapshot_download

        directory = Path(
            snapshot_download(
                model.name_or_path, revision=model.revision, allow_patterns=["*.safetensors", "*.json"]
            )
        )
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UserError(
            f"model.name_or_path={model.name_or_path}: no *.safetensors weights; pipeline stages load "
            "safetensors only (convert with save_pretrained(safe_serialization=True))"
        )
    return files


def _full_random_state(run: Resolved, config: PretrainedConfig) -> dict[str, torch.Tensor]:
    # init=random builds the whole model once with the recipe's seed, exactly as the other
    # paths do, so a pipeline run starts from the same weights as a single-process run.
    from transformers import AutoModelForCausalLM

    torch.manual_seed(run.recipe.optim.seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).state_dict()


def load_stage_weights(module: nn.Module, run: Resolved, config: PretrainedConfig, names: LayerMap) -> int:
    """Copy this stage's HF weights into its layers; every local parameter must be found."""
    wanted = {name for name, _ in module.named_parameters()}
    local = module.state_dict()
    found: set[str] = set()

    def take(hf_name: str, read: Callable[[], torch.Tensor]) -> None:
        pipe_name = names.to_pipe(hf_name)
        if pipe_name in wanted:
            with torch.no_grad():
                local[pipe_name].copy_(read())
            found.add(pipe_name)

    if run.recipe.model.init == "random":
        state = _full_random_state(run, config)
        for hf_name in state:
            take(hf_name, partial(state.__getitem__, hf_name))
    else:
        from safetensors import safe_open

        for file in _weight_files(run):
            with safe_open(str(file), framework="pt") as handle:
                for hf_name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    take(hf_name, partial(handle.get_tensor, hf_name))
    missing = sorted(wanted - found)
    if missing:
        raise UserError(
            f"model.name_or_path={run.recipe.model.name_or_path}: {len(missing)} weights of this pipeline stage "
            f"are not in the checkpoint, e.g. {names.to_hf(missing[0])}"
        )
    return len(found)


def stage_hf_state(module: nn.Module, names: LayerMap, first_stage: bool) -> dict[str, torch.Tensor]:
    """This stage's weights under their HF names (a tied embedding is written by the first stage only)."""
    out = {}
    for name, tensor in module.state_dict().items():
        hf_name = names.to_hf(name)
        if hf_name is None or (name.startswith("tied_modules.") and not first_stage):
            continue
        out[hf_name] = tensor.detach().to("cpu").contiguous().clone()
    return out


def export_pipeline(
    engine: PipelineEngine,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    names: LayerMap,
    out_dir: Path,
) -> None:
    """A plain HF directory: one safetensors shard per stage, the index, config and tokenizer.

    Called on every rank; the data-parallel rank 0 of each stage writes its shard (the run
    directory must be on a filesystem all nodes share, as for checkpoints).
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    grid = engine.grid
    stage, stages = grid.get_stage_id(), grid.get_pipe_parallel_world_size()
    shard = f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"
    keys: list[tuple[str, int]] = []
    if grid.get_data_parallel_id() == 0:
        state = stage_hf_state(engine.module, names, engine.is_first_stage())
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out_dir / shard), metadata={"format": "pt"})
        keys = [(k, v.numel() * v.element_size()) for k, v in state.items()]
    gathered = collectives.WORLD.gather_objects((shard, keys))
    if collectives.rank() == 0:
        weight_map = {key: name for name, entries in gathered for key, _ in entries}
        total = sum(size for _, entries in gathered for _, size in entries)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        config.dtype = next(engine.module.parameters()).dtype
        config.use_cache = True
        config.save_pretrained(out_dir)
        with contextlib.suppress(ValueError):  # a config without generation fields: nothing to write
            GenerationConfig.from_model_config(config).save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    collectives.WORLD.barrier()
