"""The pipeline engine: DeepSpeed's `PipelineEngine` over the stages of runtime/engines/pipeline_model.py.

Accelerate does not drive DeepSpeed's pipeline engine, so this engine joins the process
group and builds the engine itself. One optimizer step is one `train_batch`, which pulls
the accumulation steps' micro-batches through the 1F1B schedule, steps the optimizer and LR
schedule, and returns the loss averaged over micro-batches and data-parallel ranks,
broadcast to every stage. What it cannot do (skip a non-finite micro-batch before backward,
Liger kernels, torch.compile, the flops profiler, LoRA) is refused by parallel.check_parallel.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from llm_train.config.resolution import Resolved
from llm_train.errors import UserError
from llm_train.observability.metrics import shape_token_flops
from llm_train.planning.model.shapes import shape_from_config
from llm_train.planning.speed.flops import TokenFlops
from llm_train.runtime.base import collectives
from llm_train.runtime.base.collectives import Collectives
from llm_train.runtime.base.compat import clip_fp32_across_stages, keep_fp32_rope_buffers
from llm_train.runtime.checkpointing.logit_reference import reference_input_ids, write_reference
from llm_train.runtime.engines.engine import Batch, StepResult, process_group_timeout
from llm_train.runtime.engines.pipeline_model import (
    build_pipeline_module,
    export_pipeline,
    hf_config,
    load_stage_weights,
)
from llm_train.runtime.loss.interface import Objective
from llm_train.runtime.loss.language_modeling import ChunkedCausalLMLoss, LanguageModeling
from llm_train.runtime.model.model import loss_tokens
from llm_train.runtime.model.optim import build_optimizer, build_scheduler
from llm_train.runtime.model.pipeline_names import LayerMap

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Pair = tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]


def as_pipeline_batch(batch: Batch) -> Pair:
    """((input_ids, position_ids), labels): the engine feeds inputs to the first stage, labels to the last."""
    input_ids = batch["input_ids"]
    position_ids = batch.get("position_ids")
    if position_ids is None:
        # repeat, not expand: tensors sent between stages must own contiguous storage.
        position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0).repeat(input_ids.shape[0], 1)
    return (input_ids, position_ids.contiguous()), batch["labels"]


class _Pairs:
    """The micro-batch stream as the pipeline engine reads it (it calls next() itself)."""

    def __init__(self, batches: Iterator[Batch]) -> None:
        self.batches = batches

    def __iter__(self) -> _Pairs:
        return self

    def __next__(self) -> Pair:
        return as_pipeline_batch(next(self.batches))


class PipelineEngine:
    def __init__(self, run: Resolved, say: Callable[[str], None]) -> None:
        self.run, self.say = run, say
        self.ds: Any = None
        self.module: Any = None
        self.skipped_microbatches = 0  # never: on_nonfinite=skip is refused for pipelines
        self.objective: Objective = (
            LanguageModeling()
        )  # preference objectives are refused for pipelines (parallel.py)
        self.config = hf_config(run)
        self.names = LayerMap(
            self.config.num_hidden_layers, bool(getattr(self.config, "tie_word_embeddings", False))
        )
        self._pairs: _Pairs | None = None

    def start(self) -> None:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        if torch.cuda.is_available():
            get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # DeepSpeed picks gloo for its CPU accelerator and NCCL on GPUs.
        deepspeed.init_distributed(
            dist_backend=get_accelerator().communication_backend_name(),
            timeout=process_group_timeout(self.run.recipe.deepspeed.timeout_minutes),
        )
        if collectives.world_size() != self.run.layout.world_size:
            raise RuntimeError(
                f"DeepSpeed sees a world of {collectives.world_size()}, the layout says {self.run.layout.world_size}"
            )
        # Each stage builds and loads only its own layers, before the engine exists.
        interval = 1 if self.run.recipe.memory.activation_checkpointing else 0
        chunked = self.run.recipe.memory.tiled_loss
        self.module = build_pipeline_module(
            self.config, self.run.layout.pp, interval, loss_tokens(self.run) if chunked else None
        )
        load_stage_weights(self.module, self.run, self.config, self.names)
        grid = self.module._grid
        expected = self.run.layout.dp_rank(collectives.rank())
        if grid.get_data_parallel_id() != expected:
            raise RuntimeError(
                f"DeepSpeed's pipeline grid puts this rank at dp {grid.get_data_parallel_id()}"
            )

    def world_info(self) -> dict[str, Any]:
        layers = [int(self.module._local_start), int(self.module._local_stop)]  # this stage's slice
        return {"stage": self.module._grid.get_stage_id(), "layers": layers}

    def summary_rows(self, ranks: list[dict[str, Any]]) -> list[tuple[str, str]]:
        split = {info["stage"]: info["layers"] for info in ranks}
        stages = ", ".join(f"{s}: layers {a}-{b - 1}" for s, (a, b) in sorted(split.items()))
        n = self.config.num_hidden_layers
        legend = f"(0 embedding, 1-{n} decoder, {self.names.norm_idx} norm, {self.names.norm_idx + 1} head)"
        return [("stages", f"{stages} {legend}")]

    def build(self, max_steps: int, mark: Callable[[str], None]) -> None:
        import deepspeed

        mark("model build")  # this stage's layers were built and loaded in start()
        run, optim = self.run, self.run.recipe.optim
        # Our schedule unless the JSON has one; DeepSpeed calls it with the unwrapped torch optimizer,
        # steps it at each optimizer step and saves it in its checkpoints (as on the Accelerate path).
        schedule = (
            None
            if "scheduler" in run.ds_config
            else partial(build_scheduler, optim=optim, max_steps=max_steps)
        )
        restore_rope = keep_fp32_rope_buffers(self.module)
        if "optimizer" in run.ds_config:  # a DS JSON with its own optimizer: DeepSpeed builds it
            params = [p for p in self.module.parameters() if p.requires_grad]
            self.ds, _, _, _ = deepspeed.initialize(
                model=self.module, model_parameters=params, config=run.ds_config, lr_scheduler=schedule
            )
        else:
            optimizer = build_optimizer(self.module, optim, run.layout.offload_optimizer)
            self.ds, _, _, _ = deepspeed.initialize(
                model=self.module, optimizer=optimizer, config=run.ds_config, lr_scheduler=schedule
            )
        restore_rope(self.ds.module)
        clip_fp32_across_stages(self.ds, Collectives(self.ds.grid.get_pipe_parallel_group()).sum)
        mark("deepspeed init")

    def token_flops(self) -> TokenFlops | None:
        return shape_token_flops(shape_from_config(self.config.to_dict()))

    def train_step(self, batches: Iterator[Batch], measure_grad_norm: bool) -> StepResult:
        if self._pairs is None or self._pairs.batches is not batches:
            self._pairs = _Pairs(batches)
        loss = self.ds.train_batch(data_iter=self._pairs)
        return StepResult(loss.detach().float().reshape(()), loss_is_global=True)

    def grad_norm(self) -> float | None:
        norm = self.ds.get_global_grad_norm()
        return float(norm) if norm is not None else None

    def evaluate(self, batches: list[Batch]) -> dict[str, float]:
        if not batches:
            return {"eval_loss": float("nan")}
        pairs = [as_pipeline_batch(b) for b in batches]
        loss = float(self.ds.eval_batch(iter(pairs), num_micro_batches=len(pairs)))
        return self.objective.eval_summary({"loss": loss})

    def export(self, final: Path, tokenizer: PreTrainedTokenizerBase) -> None:
        reference = self.reference_logits(tokenizer)  # every stage takes part
        export_pipeline(self.ds, self.config, tokenizer, self.names, final)
        if collectives.rank() == 0:  # export_pipeline ended with a barrier: final/ is complete
            write_reference(final, *reference)

    def reference_logits(self, tokenizer: PreTrainedTokenizerBase) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, logits) of the trained pipeline on the export check's fixed batch, on every rank.

        One micro-batch through the engine's own inference schedule; the logits come out on the
        last stage of each pipeline and are passed to every rank (rank 0 verifies the export).
        """
        input_ids = reference_input_ids(tokenizer, self.config.get_text_config().vocab_size)
        pair = as_pipeline_batch({"input_ids": input_ids, "labels": input_ids})
        # The stages exchanged training-shaped activations so far: let them agree on the new shape,
        # and again afterwards (a later train or eval batch has the training shape).
        self.ds.reset_activation_shape()
        _, logits = self.ds.eval_batch(iter([pair]), return_logits=True, num_micro_batches=1)
        self.ds.reset_activation_shape()
        holder = self.ds.is_last_stage() and self.ds.grid.get_data_parallel_id() == 0
        if holder and isinstance(self.module.loss_fn, ChunkedCausalLMLoss):
            with torch.no_grad():  # the chunked loss took the output layer: the stage returned hidden states
                logits = self.module.loss_fn.head(logits)
        gathered = collectives.WORLD.gather_objects(logits.detach().cpu() if holder else None)
        return input_ids, next(t for t in gathered if t is not None)

    def benchmark_model(self) -> AbstractContextManager[Any]:
        # Never called: each stage holds part of the model (runtime/benchmark.py `unavailable`).
        raise UserError("eval.tasks cannot run on pipeline stages")

    def finish(self) -> None:
        collectives.destroy()
