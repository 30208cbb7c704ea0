"""Every recipe option under pipeline parallelism (pp=2), classified: it works in a real run, or is refused.

The pipeline engine shares the session and the step loop with the ZeRO engine (llm_train/runtime/);
what it cannot do must be refused when the run is resolved, in one line, never ignored. OPTIONS
classifies every leaf key of the recipe schema: tests/unit/test_pipeline_options.py fails when a new key
is not classified and checks the refusals through the dry run; tests/e2e/test_pipeline_options.py sets
the "works" options together in two real 2-process runs (two, because some of them exclude each other).
"""

from __future__ import annotations

import typing

from pydantic import BaseModel

RUN_A, RUN_B = "a", "b"
PIPELINE_HAS_NO_WHOLE_MODEL = "deepspeed.pipeline_stages=2: each stage holds part of the model"

# key -> (RUN_A | RUN_B, override) for options exercised in a run; ("refused", override, message);
# ("skipped", override, message): the run trains on without it and says why in one notice.


def _without_objective(override: str) -> tuple[str, str, str]:
    """An option of another objective: with objective lm it is refused as set without that objective."""
    return ("refused", override, f"{override.split('=')[0]} is set but objective is lm")


OPTIONS: dict[str, tuple[str, str] | tuple[str, str, str]] = {
    "name": (RUN_A, "name=tiny-pp-options"),
    "description": (RUN_A, "description=options walk"),
    "hardware.device": (RUN_A, "hardware.device=cpu"),
    "hardware.nodes": (RUN_A, "hardware.nodes=1"),
    "hardware.processes_per_node": (RUN_A, "hardware.processes_per_node=2"),
    "hardware.gpu_name": (RUN_A, "hardware.gpu_name=RTX 4090"),
    "hardware.gpu_mem_gib": (RUN_A, "hardware.gpu_mem_gib=24"),
    "hardware.host_ram_gib": (RUN_A, "hardware.host_ram_gib=4"),
    "model.name_or_path": (RUN_B, "model.name_or_path={pretrained}"),
    "model.init": (RUN_B, "model.init=pretrained"),
    "model.config": (RUN_A, "model.config.rms_norm_eps=1e-5"),
    "model.tokenizer": (RUN_A, "model.tokenizer={tokenizer}"),
    "model.revision": (RUN_B, "model.revision=main"),  # a local directory has no revisions: ignored by HF
    "model.trust_remote_code": (RUN_A, "model.trust_remote_code=false"),
    # Image-text settings: a text model has no vision tower or projector, and text sources no images; a text
    # pipeline run accepts them as it accepts them without pipeline stages (its default freeze is these two).
    "model.freeze": (RUN_A, "model.freeze=[vision_tower,projector]"),
    "data.train": (RUN_A, "data.train=[{corpus}]"),
    "data.eval": (RUN_B, "data.eval=[{corpus}]"),
    "data.eval_fraction": (RUN_A, "data.eval_fraction=0.1"),
    "data.text_field": (RUN_A, "data.text_field=text"),
    "data.seq_len": (RUN_A, "data.seq_len=64"),
    "data.packing": (RUN_A, "data.packing=padded"),
    "data.chat_template": (RUN_A, "data.chat_template=unused by text sources"),
    "data.cache_dir": (RUN_A, "data.cache_dir={cache}"),
    "data.num_proc": (RUN_A, "data.num_proc=1"),
    "data.loader_workers": (RUN_A, "data.loader_workers=1"),
    "data.tokenize_memo": (RUN_B, "data.tokenize_memo=false"),
    "data.max_epochs": (RUN_A, "data.max_epochs=5"),
    "data.image_max_pixels": (RUN_A, "data.image_max_pixels=1000000"),
    "data.image_min_pixels": (RUN_A, "data.image_min_pixels=1000"),
    "optim.lr": (RUN_A, "optim.lr=1e-3"),
    "optim.weight_decay": (RUN_A, "optim.weight_decay=0.1"),
    "optim.betas": (RUN_A, "optim.betas=[0.8,0.9]"),
    "optim.eps": (RUN_A, "optim.eps=1e-6"),
    "optim.schedule": (RUN_A, "optim.schedule=linear"),
    "optim.warmup_steps": (RUN_A, "optim.warmup_steps=1"),
    "optim.min_lr_ratio": (RUN_A, "optim.min_lr_ratio=0.2"),
    "optim.grad_clip": (RUN_A, "optim.grad_clip=0.5"),
    "optim.micro_batch_size": (RUN_A, "optim.micro_batch_size=4"),
    "optim.grad_accum": (RUN_B, "optim.grad_accum=2"),
    "optim.global_batch_size": (RUN_A, "optim.global_batch_size=8"),
    "optim.max_steps": (RUN_A, "optim.max_steps=4"),
    "optim.epochs": (RUN_B, "optim.epochs=0.02"),
    "optim.seed": (RUN_A, "optim.seed=7"),
    "optim.name": (RUN_B, "optim.name=adamw_8bit"),
    "optim.state_dtype": (
        "refused",
        "optim.state_dtype=bf16",
        "optim.state_dtype=bf16 is not supported with deepspeed.pipeline_stages=2",
    ),
    "precision": (RUN_A, "precision=bf16"),
    "memory.activation_checkpointing": (RUN_A, "memory.activation_checkpointing=true"),
    "memory.attention": (RUN_A, "memory.attention=eager"),
    "memory.liger_kernels": (
        "refused",
        "memory.liger_kernels=true",
        "memory.liger_kernels=true is not supported",
    ),
    "memory.tiled_mlp": ("refused", "memory.tiled_mlp=true", "memory.tiled_mlp=true is not supported"),
    "memory.tiled_loss": (RUN_B, "memory.tiled_loss=true"),
    "memory.offload_checkpoints": (
        "refused",
        "memory.offload_checkpoints=true",
        "memory.offload_checkpoints=true offloads the activation checkpoints, but",
    ),
    "memory.torch_compile": (
        "refused",
        "memory.torch_compile=layers",
        "memory.torch_compile=layers is not supported",
    ),
    "lora.rank": ("refused", "lora.rank=8", "lora is not supported with deepspeed.pipeline_stages=2"),
    "lora.alpha": ("refused", "lora.alpha=16", "lora is not supported with deepspeed.pipeline_stages=2"),
    "lora.dropout": ("refused", "lora.dropout=0.0", "lora is not supported with deepspeed.pipeline_stages=2"),
    "lora.target_modules": (
        "refused",
        "lora.target_modules=[q_proj]",
        "lora is not supported with deepspeed.pipeline_stages=2",
    ),
    "lora.export": (
        "refused",
        "lora.export=adapter",
        "lora is not supported with deepspeed.pipeline_stages=2",
    ),
    # Preference objectives need pair data, which a text run does not have; with pairs the pipeline
    # itself refuses them (tests/unit/test_preference.py: "is not supported with deepspeed.pipeline_stages").
    "objective": ("refused", "objective=dpo", "but objective=dpo trains on pairs"),
    "preference.beta": _without_objective("preference.beta=0.2"),
    "preference.label_smoothing": _without_objective("preference.label_smoothing=0.1"),
    "preference.simpo_gamma": _without_objective("preference.simpo_gamma=1.0"),
    "preference.reference": _without_objective("preference.reference=live"),
    # GRPO and reward-model options belong to their objectives (which run without pipeline stages): with
    # objective lm each is refused as set without its objective.
    "grpo.beta": _without_objective("grpo.beta=0.04"),
    "grpo.ds3_gather_for_generation": _without_objective("grpo.ds3_gather_for_generation=false"),
    "grpo.epsilon": _without_objective("grpo.epsilon=0.3"),
    "grpo.epsilon_high": _without_objective("grpo.epsilon_high=0.28"),
    "grpo.importance_sampling_level": _without_objective("grpo.importance_sampling_level=sequence"),
    "grpo.loss_type": _without_objective("grpo.loss_type=grpo"),
    "grpo.mask_truncated_completions": _without_objective("grpo.mask_truncated_completions=true"),
    "grpo.max_completion_length": _without_objective("grpo.max_completion_length=32"),
    "grpo.num_generations": _without_objective("grpo.num_generations=4"),
    "grpo.num_iterations": _without_objective("grpo.num_iterations=2"),
    "grpo.rewards": _without_objective("grpo.rewards=[{kind: format, pattern: x}]"),
    "grpo.scale_rewards": _without_objective("grpo.scale_rewards=batch"),
    "grpo.temperature": _without_objective("grpo.temperature=0.7"),
    "grpo.top_k": _without_objective("grpo.top_k=5"),
    "grpo.top_p": _without_objective("grpo.top_p=0.9"),
    "grpo.min_p": _without_objective("grpo.min_p=0.05"),
    "grpo.repetition_penalty": _without_objective("grpo.repetition_penalty=1.1"),
    "grpo.generation_kwargs": _without_objective("grpo.generation_kwargs={no_repeat_ngram_size: 2}"),
    "grpo.chat_template_kwargs": _without_objective("grpo.chat_template_kwargs={enable_thinking: false}"),
    "grpo.use_transformers_continuous_batching": _without_objective(
        "grpo.use_transformers_continuous_batching=true"
    ),
    "grpo.delta": _without_objective("grpo.delta=1.5"),
    "grpo.sapo_temperature_pos": _without_objective("grpo.sapo_temperature_pos=0.9"),
    "grpo.sapo_temperature_neg": _without_objective("grpo.sapo_temperature_neg=1.1"),
    "grpo.vespo_k_pos": _without_objective("grpo.vespo_k_pos=1.0"),
    "grpo.vespo_lambda_pos": _without_objective("grpo.vespo_lambda_pos=1.0"),
    "grpo.vespo_k_neg": _without_objective("grpo.vespo_k_neg=1.0"),
    "grpo.vespo_lambda_neg": _without_objective("grpo.vespo_lambda_neg=1.0"),
    "grpo.reward_weights": _without_objective("grpo.reward_weights=[1.0]"),
    "grpo.disable_dropout": _without_objective("grpo.disable_dropout=true"),
    "grpo.log_completions": _without_objective("grpo.log_completions=true"),
    "grpo.num_completions_to_print": _without_objective("grpo.num_completions_to_print=2"),
    # TRL options not built yet: refused by the grpo section itself, whatever the objective.
    "grpo.generation_batch_size": ("refused", "grpo.generation_batch_size=32", "is not built yet"),
    "grpo.steps_per_generation": ("refused", "grpo.steps_per_generation=2", "is not built yet"),
    "grpo.sync_ref_model": ("refused", "grpo.sync_ref_model=true", "is not built yet"),
    "grpo.ref_model_mixup_alpha": ("refused", "grpo.ref_model_mixup_alpha=0.5", "is not built yet"),
    "grpo.ref_model_sync_steps": ("refused", "grpo.ref_model_sync_steps=64", "is not built yet"),
    "grpo.num_generations_eval": ("refused", "grpo.num_generations_eval=2", "is not built yet"),
    "reward.center_rewards_coefficient": _without_objective("reward.center_rewards_coefficient=0.01"),
    "reward.margin": _without_objective("reward.margin=0.5"),
    # A quantised base is loaded from a checkpoint; tiny-cpu-pp2 builds a random one, refused first.
    "lora.quantize": ("refused", "lora.quantize=int8", "lora.quantize=int8 quantises a pretrained base"),
    "deepspeed.config": (RUN_B, "deepspeed.config=zero0"),
    "deepspeed.pipeline_stages": (RUN_A, "deepspeed.pipeline_stages=2"),
    "deepspeed.sequence_parallel": (
        "refused",
        "deepspeed.sequence_parallel=2",
        "deepspeed.sequence_parallel=2 cannot be combined with tensor parallel",
    ),
    "deepspeed.nvme_path": ("refused", "deepspeed.nvme_path=/tmp", "offloads nothing to nvme"),
    "deepspeed.timeout_minutes": (RUN_A, "deepspeed.timeout_minutes=10"),
    "deepspeed.pinning": (RUN_A, "deepspeed.pinning=off"),
    "eval.every": (RUN_A, "eval.every=2"),
    "eval.batches": (RUN_A, "eval.batches=2"),
    # lm-eval runs one whole model on rank 0; a pipeline stage holds part of it (runtime/benchmark.py).
    "eval.tasks": ("skipped", "eval.tasks=[llm_train_tiny]", PIPELINE_HAS_NO_WHOLE_MODEL),
    "eval.tasks_every": ("skipped", "eval.tasks_every=2", PIPELINE_HAS_NO_WHOLE_MODEL),
    "eval.tasks_limit": ("skipped", "eval.tasks_limit=4", PIPELINE_HAS_NO_WHOLE_MODEL),
    "eval.tasks_batch_size": ("skipped", "eval.tasks_batch_size=2", PIPELINE_HAS_NO_WHOLE_MODEL),
    "eval.tasks_include_path": ("skipped", "eval.tasks_include_path=[{corpus}]", PIPELINE_HAS_NO_WHOLE_MODEL),
    "output.dir": (RUN_A, "output.dir={run_dir}"),
    "output.log_every": (RUN_A, "output.log_every=1"),
    "output.sample_prompt": (RUN_A, "output.sample_prompt=The"),
    "checkpoint.every_steps": (RUN_A, "checkpoint.every_steps=2"),
    "checkpoint.every_minutes": (RUN_B, "checkpoint.every_minutes=60"),
    "checkpoint.at_end": (RUN_B, "checkpoint.at_end=false"),
    "checkpoint.keep_last_n": (RUN_A, "checkpoint.keep_last_n=2"),
    "checkpoint.grace_s": (RUN_A, "checkpoint.grace_s=30"),
    "checkpoint.on_nonfinite": (
        "refused",
        "checkpoint.on_nonfinite=skip",
        "checkpoint.on_nonfinite=skip is not supported",
    ),
    "tracking.mode": (RUN_A, "tracking.mode=offline"),
    "tracking.project": (RUN_A, "tracking.project=pp-options"),
    "tracking.entity": (RUN_A, "tracking.entity=nobody"),
    "tracking.run_name": (RUN_A, "tracking.run_name=walk"),
    "tracking.tags": (RUN_A, "tracking.tags=[pp]"),
    "tracking.group": (RUN_A, "tracking.group=walk"),
    "tracking.tensorboard": (RUN_A, "tracking.tensorboard=true"),
}
# Refused values that are option values rather than keys (the key itself works in a run above).
REFUSED_VALUES = [
    ("deepspeed.config=zero2", "needs ZeRO stage 0 or 1"),
    ("memory.attention=flash_attention_2", "flash_attention_2 needs a CUDA GPU"),
    ("memory.attention=sdpa_flex", "memory.attention=sdpa_flex cannot train on CPU"),
    ("precision=fp16", "precision=fp16 is not supported on CPU"),
]


def leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        sections = [a for a in (typing.get_args(field.annotation) or (field.annotation,)) if _is_model(a)]
        if sections and name != "config":
            keys += leaf_keys(sections[0], f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def _is_model(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)
