"""The recipe's sections: hardware, model, data, optimiser, memory, LoRA, DeepSpeed, eval, output, checkpoints,
tracking (each a strict `Section`; the objectives' own sections are in objective_sections.py).

Field descriptions are the user's documentation: docs/recipe.md and `llm-train show --schema` are
written from them (recipe_reference.py). Checks that involve one section live on it; checks across
sections live on `Recipe` (recipe.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SerializeAsAny, field_validator, model_validator

from llm_train.config.credentials import is_secret_key
from llm_train.config.section import Section
from llm_train.config.source_schema import SOURCE_CLASSES, Source, TextSource, parse_source


class HardwareSection(Section):
    """The hardware the recipe is written for; `--dry-run` assumes it when no --world-size is given."""

    device: Literal["cuda", "cpu"] = Field("cuda", description="Accelerator type the recipe targets.")
    nodes: int = Field(1, ge=1, description="Number of machines.")
    processes_per_node: int = Field(1, ge=1, description="Processes per machine (GPUs per node on CUDA).")
    gpu_name: str | None = Field(None, description="GPU model the recipe was sized for, e.g. 'A100-80GB'.")
    gpu_mem_gib: float | None = Field(None, gt=0, description="GPU memory per device the recipe needs, GiB.")
    host_ram_gib: float | None = Field(None, gt=0, description="Host RAM per node the recipe needs, GiB.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node


ModelPart = Literal["vision_tower", "projector", "language_model"]
FREEZE_PARTS: tuple[ModelPart, ...] = ("vision_tower", "projector", "language_model")
# Text data gives the vision tower and projector no gradient, and weight decay would still shrink them; a
# run on images usually keeps the pretrained vision encoder too (LLaMA-Factory's freeze_vision_tower default).
FREEZE_DEFAULT: tuple[ModelPart, ...] = ("vision_tower", "projector")


class ModelSection(Section):
    """Which causal LM is trained and how it is created."""

    name_or_path: str | None = Field(
        None, description="Hugging Face hub id or local directory of a causal LM (from_pretrained)."
    )
    init: Literal["pretrained", "random"] = Field(
        "pretrained", description="'pretrained' loads weights; 'random' builds the architecture only."
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="HF config fields; for init=random with no name_or_path it must hold model_type.",
    )
    tokenizer: str | None = Field(None, description="Tokenizer id or directory; defaults to name_or_path.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) to load.")
    trust_remote_code: bool = Field(
        False, description="Run model code from the hub; off unless you trust it."
    )
    # LLaMA-Factory's freeze_vision_tower / freeze_multi_modal_projector / freeze_language_model, as one list.
    freeze: list[ModelPart] = Field(
        default_factory=lambda: list(FREEZE_DEFAULT),
        description="Parts of an image-text model that do not train: vision_tower, projector, language_model "
        "(default: the vision tower and projector; text data cannot teach them). Ignored for a text-only model.",
    )

    @model_validator(mode="after")
    def _something_trains(self) -> ModelSection:
        if len(set(self.freeze)) == len(FREEZE_PARTS):
            raise ValueError(
                "model.freeze lists every part (vision_tower, projector, language_model), so nothing would train; "
                "leave at least one out (the default freezes vision_tower and projector)"
            )
        return self

    @model_validator(mode="after")
    def _no_credentials(self) -> ModelSection:
        for key in self.config:
            if is_secret_key(key):
                # model.config is copied into the exported config.json and the run's recipe.yaml.
                raise ValueError(
                    f"model.config.{key} looks like a credential; recipes are saved with every run, "
                    "so pass secrets through the environment (HF_TOKEN, WANDB_API_KEY) instead"
                )
        return self

    @model_validator(mode="after")
    def _source_is_known(self) -> ModelSection:
        if self.init == "pretrained" and not self.name_or_path:
            raise ValueError("model.init=pretrained needs model.name_or_path (a hub id or a local directory)")
        if self.init == "random" and not self.name_or_path and "model_type" not in self.config:
            raise ValueError("model.init=random needs model.name_or_path or model.config.model_type")
        if not self.tokenizer and not self.name_or_path:
            raise ValueError("model.tokenizer is required when model.name_or_path is not set")
        return self


class DataSection(Section):
    """Where the training data comes from and how it becomes packed sequences (see llm_train/data/)."""

    # SerializeAsAny: a source dumps its own format's keys (parse_source made it that class), not only Source's.
    train: list[str | SerializeAsAny[Source]] = Field(
        min_length=1,
        description="Sources: paths/globs of text (.txt, .jsonl/.json/.parquet/.csv with data.text_field), or "
        f"mappings {{path, format: {'|'.join(SOURCE_CLASSES)}, weight, ...}}.",
    )
    eval: list[str | SerializeAsAny[Source]] = Field(
        default_factory=list,
        description="Held-out sources (same forms as train); empty = carve eval_fraction.",
    )
    eval_fraction: float = Field(
        0.05, ge=0.0, lt=0.5, description="Share of each train source's samples held out for eval."
    )
    text_field: str = Field("text", description="Field that holds the text in rows of text sources.")
    seq_len: int = Field(1024, ge=8, description="Tokens per training sequence (packed or padded).")
    packing: Literal["packed", "padded"] = Field(
        "packed",
        description="'packed': several samples per sequence, position ids restart per sample and no "
        "attention crosses samples; 'padded': one sample per sequence, padded.",
    )
    chat_template: str | None = Field(
        None,
        description="Jinja chat template (or a path to a .jinja file) for chat sources; default the tokenizer's.",
    )
    image_max_pixels: int | None = Field(
        None,
        ge=1,
        description="image_chat sources: images with more pixels (width x height) are shrunk to this, aspect kept, "
        "before the processor sees them (LLaMA-Factory's image_max_pixels); default: the processor's own sizing.",
    )
    image_min_pixels: int | None = Field(
        None,
        ge=1,
        description="image_chat sources: images with fewer pixels are enlarged to this, aspect kept, before the "
        "processor sees them; default: the processor's own sizing.",
    )
    cache_dir: str = Field(
        "~/.cache/llm_train/data",
        description="Where tokenised and packed data are cached (keyed by content).",
    )
    num_proc: int | None = Field(
        None,
        ge=1,
        description="Processes for tokenisation; default: one per 16 MB of source, up to the CPU count (capped at 8).",
    )
    loader_workers: int | None = Field(
        None,
        ge=0,
        description="DataLoader worker processes; default 2 on CUDA (pinned memory), 0 on CPU and "
        "0 with the optimizer offloaded (forked workers would copy its host-RAM state).",
    )
    tokenize_memo: bool = Field(
        True,
        description="Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2) tokenise word by word through a memo "
        "(data/tokenize_memo.py): the tokenizer's exact ids for less CPU (bench/data.py's tokenise lines); "
        "false: every text through the tokenizer itself.",
    )
    max_epochs: float = Field(
        3.0,
        gt=0,
        description="Refuse a run whose optim.max_steps (or optim.epochs) means more passes than this over "
        "the training data; a guard against a large run on a small corpus.",
    )

    @model_validator(mode="before")
    @classmethod
    def _sources(cls, values: Any) -> Any:
        if isinstance(values, dict):
            for key in ("train", "eval"):
                items = values.get(key)
                if isinstance(items, (str, dict)):
                    items = [items]
                if isinstance(items, list):
                    values = {
                        **values,
                        key: [parse_source(v, f"data.{key}[{i}]") for i, v in enumerate(items)],
                    }
        return values

    @model_validator(mode="after")
    def _streaming_is_all_or_none(self) -> DataSection:
        # A stream has no length: it cannot share an epoch with counted sources or have eval carved from it.
        flags = [not isinstance(s, str) and s.streaming for s in self.train]
        if any(flags) and not all(flags):
            raise ValueError(
                f"data.train[{flags.index(False)}] is not streamed while data.train[{flags.index(True)}] is; "
                "set streaming: true on every data.train source or on none"
            )
        for i, source in enumerate(self.eval):
            if not isinstance(source, str) and source.streaming:
                raise ValueError(
                    f"data.eval[{i}].streaming=true: eval sets are read whole; remove streaming from data.eval"
                )
        if any(flags) and not self.eval and self.eval_fraction > 0:
            raise ValueError(
                "data.train is streamed, so data.eval_fraction cannot be carved from it; give data.eval sources "
                "or set data.eval_fraction=0"
            )
        return self

    @model_validator(mode="after")
    def _image_rows_are_padded(self) -> DataSection:
        # An image row's pixels belong to the whole row: packing several into one sequence would need the
        # vision tower's inputs split per sample, which no processor output says how to do (TRL packs no VLM
        # rows either), and a streamed row's pixels have no place in the stream's token windows.
        for key in ("train", "eval"):
            for i, source in enumerate(getattr(self, key)):
                if isinstance(source, str) or source.format != "image_chat":
                    continue
                if self.packing == "packed":
                    raise ValueError(
                        f"data.{key}[{i}] is format image_chat, whose rows are one sample per sequence (an image's "
                        "pixels cannot be split between packed samples); set data.packing=padded"
                    )
                if source.streaming:
                    raise ValueError(
                        f"data.{key}[{i}].streaming=true: image_chat rows are processed up front (their pixels "
                        "are cached with the tokens); remove streaming"
                    )
        return self

    def sources(self, split: Literal["train", "eval"]) -> list[Source]:
        """The sources of one split, path strings turned into text sources that read data.text_field."""
        items = self.train if split == "train" else self.eval
        return [(TextSource(path=item) if isinstance(item, str) else item).filled(self) for item in items]


class OptimSection(Section):
    """Optimiser, schedule and batch arithmetic."""

    lr: float = Field(gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup length in optimizer steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of lr (cosine/linear).")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this; 0 disables.")
    micro_batch_size: int = Field(
        1,
        ge=1,
        description="Sequences per process per forward pass (preference pairs, two sequences each, under "
        "objective dpo or simpo).",
    )
    grad_accum: int | None = Field(
        None, ge=1, description="Micro-batches per optimizer step; derived from global_batch_size if unset."
    )
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences (preference pairs under objective dpo or simpo) per optimizer step over all "
        "data-parallel ranks.",
    )
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps to train.")
    epochs: float | None = Field(
        None, gt=0, description="Passes over the training data (if max_steps unset)."
    )
    seed: int = Field(42, description="Seed for model init, data order and dropout.")
    name: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = Field(
        "adamw",
        description="The optimizer: torch's AdamW (fp32 moments), or bitsandbytes' AdamW8bit / PagedAdamW8bit "
        "(8-bit blockwise moments: 2 instead of 8 bytes per trained parameter; paged: they move to host RAM "
        "when the GPU runs short, CUDA only). 8-bit needs the optimizer on the GPU (no offload_optimizer) "
        "and ZeRO 0-2; pip install 'llm_train[qlora]'.",
    )
    state_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="Master weights, gradients and Adam states: fp32, or bf16 to halve their host RAM "
        "(DeepSpeed bf16_master_weights_and_grads + bf16_optimizer_states; needs precision bf16 and "
        "optimizer CPU offload).",
    )

    @model_validator(mode="after")
    def _length_is_known(self) -> OptimSection:
        if self.max_steps is None and self.epochs is None:
            raise ValueError("set optim.max_steps or optim.epochs")
        return self


class MemorySection(Section):
    """Memory techniques that trade compute for memory."""

    activation_checkpointing: bool = Field(False, description="Recompute layer activations in backward.")
    attention: Literal["auto", "sdpa", "sdpa_flex", "flex_attention", "flash_attention_2", "eager"] = Field(
        "auto",
        description="Attention kernel. 'auto': the fastest exact one installed that is known to train on the card "
        "(flash_attention_2, else sdpa_flex where flex_attention's backward fits the GPU's shared memory at the "
        "model's head_dim, else sdpa; sdpa on CPU; the dry run says which). 'sdpa_flex': sdpa with is_causal for batches without "
        "sample boundaries or padding, flex_attention with a block mask per document for the others (GPU, "
        "torch >= 2.5). flash_attention_2 needs the flash-attn package and a GPU.",
    )
    liger_kernels: bool = Field(
        False,
        description="Liger Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy); needs liger-kernel and a GPU.",
    )
    torch_compile: Literal["off", "model", "layers"] = Field(
        "off",
        description="torch.compile: 'layers' compiles each decoder layer in place (one compile, reused by every "
        "layer), 'model' the whole model through DeepSpeed's engine.compile(); the first steps compile. "
        "true/false mean 'model'/'off'.",
    )
    tiled_mlp: bool = Field(
        False,
        description="Run each decoder MLP over the sequence in tiles (DeepSpeed ALST TiledMLP): its "
        "intermediate activations exist for one tile at a time. Long sequences only.",
    )
    tiled_loss: bool = Field(
        False,
        description="Compute the output layer and the loss in chunks of tokens (at most 64 MiB of fp32 logits "
        "each), recomputed in backward: the [tokens x vocabulary] logits are never materialised. Exact; every "
        "objective and engine; Liger's fused linear cross-entropy with memory.liger_kernels where it can run.",
    )
    offload_checkpoints: bool = Field(
        False,
        description="Keep the activation-checkpoint inputs (one hidden state per layer) in host RAM "
        "between forward and backward; needs memory.activation_checkpointing=true.",
    )

    @field_validator("torch_compile", mode="before")
    @classmethod
    def _compile_bool(cls, value: Any) -> Any:
        # The switch was a bool before regional compilation existed: true meant the whole model.
        if isinstance(value, bool):
            return "model" if value else "off"
        return value

    @model_validator(mode="after")
    def _compile_not_with_alst(self) -> MemorySection:
        # The ALST switches patch forwards with their own autograd functions and saved-tensor hooks;
        # torch.compile over them is not verified, so it is refused rather than trusted.
        tiled = [n for n in ("tiled_mlp", "tiled_loss", "offload_checkpoints") if getattr(self, n)]
        if self.torch_compile != "off" and tiled:
            raise ValueError(
                f"memory.torch_compile={self.torch_compile} is not verified with memory.{tiled[0]}=true; "
                f"set memory.torch_compile=off or memory.{tiled[0]}=false"
            )
        return self

    @model_validator(mode="after")
    def _offload_needs_checkpoints(self) -> MemorySection:
        if self.offload_checkpoints and not self.activation_checkpointing:
            raise ValueError(
                "memory.offload_checkpoints=true offloads the activation checkpoints, but "
                "memory.activation_checkpointing is false; set memory.activation_checkpointing=true"
            )
        return self


class LoraSection(Section):
    """LoRA through PEFT: the base model is frozen and low-rank adapters are trained."""

    rank: int = Field(16, ge=1, description="Adapter rank r.")
    alpha: float = Field(32.0, gt=0, description="Adapter updates are scaled by alpha / rank.")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Names of the linear modules that get adapters (all attention and MLP projections).",
    )
    export: Literal["merged", "adapter"] = Field(
        "merged", description="'merged': a plain HF model with the adapters folded in; 'adapter': PEFT files."
    )
    quantize: Literal["none", "nf4", "int8"] = Field(
        "none",
        description="Load the frozen base through bitsandbytes (QLoRA): 'nf4' = 4-bit NormalFloat with double "
        "quantisation, 'int8' = LLM.int8(); embeddings and output layer stay 16-bit. Needs "
        "pip install 'llm_train[qlora]'.",
    )


class DeepSpeedSection(Section):
    config: str = Field(description="A name in ds_configs/ (e.g. 'zero3') or a path to a DeepSpeed JSON.")
    pipeline_stages: int = Field(
        1,
        ge=1,
        description="Pipeline-parallel degree: the model is cut into this many stages (ZeRO-0/1 only).",
    )
    sequence_parallel: int = Field(
        1,
        ge=1,
        description="Ulysses sequence-parallel degree (DeepSpeed ALST through Accelerate): each sequence "
        "is split over this many consecutive ranks, which see the same samples (world = dp x tp x pp x sp).",
    )
    nvme_path: str | None = Field(
        None,
        description="Directory on a fast local NVMe drive for ZeRO-Infinity offload (DS JSON device 'nvme'); "
        "checked for existence, write access and free space before the run starts.",
    )
    pinning: Literal["torch", "native", "off", "auto"] = Field(
        "torch",
        description="How the offload buffers the DS JSON pins (pin_memory) are allocated: 'torch' "
        "(DeepSpeed's default: torch's pinned allocator rounds each up to a power of two), 'native' (exact "
        "size, mlocked: DS_PIN_MEMORY_BACKEND=native; needs a memlock limit (ulimit -l) that large, checked "
        "before start), 'off' (pin_memory false everywhere: exact, pageable, slower copies), 'auto' ('native' "
        "when the memlock limit allows it, else 'torch' when its rounded total fits the host RAM, else 'off'; "
        "with a notice).",
    )

    @field_validator("pinning", mode="before")
    @classmethod
    def _yaml_off_is_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` (also from `deepspeed.pinning=off` on the command line) as false.
        return "off" if value is False else value

    # 30 minutes: the longest wait inside a collective in the largest shipped recipe (70b-zero3, 32
    # ranks) is one rank writing its ~25 GiB checkpoint share or a ~1 min step, minutes at worst on a
    # busy shared filesystem; hashing and conversion never wait inside one (runtime/checkpointing/file_sync.py).
    # `llm-train plan` and --dry-run print the checkpoint's expected times against it.
    timeout_minutes: float = Field(
        30.0,
        gt=0,
        description="Process-group timeout (NCCL/gloo), given to Accelerate and DeepSpeed: a collective fails "
        "after waiting this long for a rank; ranks waiting for checkpoint work through files use it too.",
    )

    @model_validator(mode="after")
    def _nvme_path_is_a_path(self) -> DeepSpeedSection:
        # The DS JSON spells "let the recipe decide" as "auto"; in the recipe itself that would
        # reach DeepSpeed as a directory literally named "auto".
        if self.nvme_path is not None and self.nvme_path.strip() in ("", "auto"):
            raise ValueError(
                f"deepspeed.nvme_path={self.nvme_path!r} is not a directory; give a path on a local NVMe "
                "drive (e.g. deepspeed.nvme_path=/mnt/nvme) or remove the key"
            )
        return self


class EvalSection(Section):
    every: int = Field(0, ge=0, description="Evaluate every N optimizer steps; 0 = only at the end.")
    batches: int = Field(8, ge=1, description="Micro-batches per evaluation (per data-parallel rank).")
    tasks: list[str] = Field(
        default_factory=list,
        description="lm-evaluation-harness tasks run on the live model during training (needs llm_train[eval]), "
        "e.g. [llm_train_tiny] (bundled, offline) or [hellaswag, arc_easy]; results logged as bench/TASK/METRIC.",
    )
    tasks_every: int = Field(
        0,
        ge=0,
        description="Run eval.tasks every N optimizer steps (and at the end); 0 = at eval.every's steps.",
    )
    tasks_limit: float | None = Field(
        None, gt=0, description="Documents per task for eval.tasks (a fraction below 1); default: all."
    )
    tasks_batch_size: int = Field(8, ge=1, description="Requests per forward pass for eval.tasks.")
    tasks_include_path: list[str] = Field(
        default_factory=list,
        description="Folders of lm-eval YAML tasks for eval.tasks, beside the bundled ones.",
    )


class OutputSection(Section):
    dir: str = Field("runs/{name}", description="Run directory; '{name}' is replaced by the recipe name.")
    log_every: int = Field(1, ge=1, description="Log metrics every N optimizer steps.")
    sample_prompt: str | None = Field(
        None, description="Text the exported model continues at the end of the run (printed)."
    )


class CheckpointSection(Section):
    """Periodic checkpoints, retention, preemption and fault handling."""

    every_steps: int = Field(0, ge=0, description="Save every N optimizer steps; 0 = not by steps.")
    every_minutes: float = Field(0.0, ge=0, description="Save every M minutes of training; 0 = not by time.")
    at_end: bool = Field(True, description="Save a checkpoint after the last step.")
    keep_last_n: int = Field(
        3, ge=2, description="Committed checkpoints kept (at least 2: one may be mid-write)."
    )
    grace_s: float = Field(
        25.0, gt=0, description="Budget to finish the step and save after SIGTERM/SIGUSR1."
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="Non-finite loss: 'stop' names the step and exits; 'skip' drops the step and counts it.",
    )


class TrackingSection(Section):
    """Experiment tracking. metrics.jsonl is always written; W&B is optional."""

    mode: Literal["disabled", "offline", "online"] = Field("disabled", description="W&B mode.")
    project: str = Field("llm-train", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user).")
    run_name: str | None = Field(None, description="W&B run name; defaults to the run directory name.")
    tags: list[str] = Field(default_factory=list, description="W&B tags.")
    group: str | None = Field(None, description="W&B group.")
    tensorboard: bool = Field(
        False, description="Also write TensorBoard event files to RUN_DIR/tensorboard/."
    )
