"""The ZeRO engine: a Hugging Face causal LM under DeepSpeed ZeRO-0..3, driven through Accelerate.

Covers data parallelism with every ZeRO stage and offload, AutoTP tensor parallelism,
Ulysses sequence parallelism (sequence_parallel.py) and LoRA. The DeepSpeed engine owns gradient accumulation: `backward` scales each micro-batch
loss by 1/accumulation and reduces gradients at the boundary, `step` updates the weights
(and the LR schedule) only at the boundary. What each micro-batch's loss is comes from the
recipe's objective (runtime/loss/: the model's token loss, a sequence-parallel rank's share of it,
DPO, SimPO, reward modelling, GRPO's); DPO's reference is
cached, the policy's own engine with its adapters disabled, or a frozen copy (reference.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from llm_train.config.objectives import objective_spec
from llm_train.config.resolution import Resolved
from llm_train.observability.metrics import model_token_flops
from llm_train.planning.speed.flops import TokenFlops
from llm_train.runtime.base.collectives import WORLD, Collectives, destroy
from llm_train.runtime.base.compat import without_hf_zero3_config
from llm_train.runtime.checkpointing.logit_reference import reference_input_ids, write_reference
from llm_train.runtime.engines.engine import (
    Batch,
    NonFiniteLoss,
    StepResult,
    process_group_timeout,
    to_device,
)
from llm_train.runtime.engines.reference import CachedReference, frozen_reference
from llm_train.runtime.engines.sequence_parallel import SequenceShard, evaluating, parallelism_config
from llm_train.runtime.export.sharded import no_gather, write_adapter, write_merged
from llm_train.runtime.export.write import EXPORT_DTYPES, save_hf_model
from llm_train.runtime.loss.interface import Objective, Scored, mean_scores
from llm_train.runtime.loss.language_modeling import LanguageModeling, SequenceParallelLM
from llm_train.runtime.loss.objective_losses import make_objective
from llm_train.runtime.loss.preference_tuning import reference_forward
from llm_train.runtime.model.fast import apply_liger, compile_notice, dynamo_plugin
from llm_train.runtime.model.lora import apply_lora, is_peft_model
from llm_train.runtime.model.model import build_model, load_tokenizer, loss_tokens, model_class
from llm_train.runtime.model.optim import build_optimizer, build_scheduler, release_moments
from llm_train.runtime.model.quantized_base import (
    Staging,
    describe_quantized,
    place_quantization_state,
    quantized,
    quantized_base,
    quantizing_on,
    release_freed_host_memory,
    staged_on_host,
)
from llm_train.runtime.rl.grpo import Grpo, rollout_logps

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from transformers import PreTrainedTokenizerBase

MAX_SKIPS = 8  # with on_nonfinite=skip: more than this means the run itself is broken

_MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


class ZeroEngine:
    def __init__(self, run: Resolved, say: Callable[[str], None]) -> None:
        self.run, self.say = run, say
        self.accelerator: Any = None
        self.ds: Any = None
        self.model: Any = None
        self.skipped_microbatches = 0
        self.objective: Objective = LanguageModeling()  # the recipe's, once the engine exists (build)
        self._reference: Any = None  # DPO with preference.reference=live and no LoRA: the frozen copy
        self._hf_ds_config: Any = None
        self._sequence: SequenceShard | None = None  # set when the run splits sequences (sp > 1)

    def start(self) -> None:
        from accelerate import Accelerator, DeepSpeedPlugin
        from accelerate.utils import InitProcessGroupKwargs

        run = self.run
        if run.layout.zero_stage == 3:
            # Registered before the model exists, so transformers builds it inside zero.Init and no
            # rank materialises the full model. The reference must stay alive while the model is built.
            from transformers.integrations import HfDeepSpeedConfig

            self._hf_ds_config = HfDeepSpeedConfig(run.ds_config)
        # Without a GPU, Accelerate must be told the backend or every rank believes it is rank 0
        # of a world of 1 while DeepSpeed runs a world of N (seen with 2 processes: every rank wrote the
        # same files and the data was not sharded). The timeout reaches DeepSpeed through
        # Accelerate (its DeepSpeed path calls deepspeed.init_distributed with these kwargs; without
        # them DeepSpeed's own default, 10 minutes, applies); world.json records what the group got.
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = process_group_timeout(run.recipe.deepspeed.timeout_minutes)
        handlers = [InitProcessGroupKwargs(backend=backend, timeout=timeout)]
        self.accelerator = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=run.ds_config),
            mixed_precision=_MIXED_PRECISION[run.layout.precision],
            kwargs_handlers=handlers,
            dynamo_plugin=dynamo_plugin(run.recipe.memory),  # memory.torch_compile: `prepare` compiles
            parallelism_config=parallelism_config(
                run.layout, run.recipe.data.seq_len, run.recipe.memory.attention
            ),
        )
        rank = int(os.environ["RANK"])
        if self.accelerator.num_processes != run.layout.world_size or self.accelerator.process_index != rank:
            raise RuntimeError(
                f"Accelerate sees rank {self.accelerator.process_index} of {self.accelerator.num_processes}, "
                f"the launcher said rank {rank} of {run.layout.world_size}"
            )

    def world_info(self) -> dict[str, Any]:
        return {}

    def summary_rows(self, ranks: list[dict[str, Any]]) -> list[tuple[str, str]]:
        return []

    def build(self, max_steps: int, mark: Callable[[str], None]) -> None:
        recipe, layout = self.run.recipe, self.run.layout
        if notice := apply_liger(recipe.memory, self.run.model_fields.get("model_type"), layout.zero_stage):
            self.say(notice)
        staged = staged_on_host(recipe.lora, layout.zero_stage)
        # A reward model scores each row at its last non-pad token: its config names the id the data pads with
        # (load_tokenizer's, which data/prepare.py pads with too).
        reward = objective_spec(recipe.objective).head == "score"
        pad_id = load_tokenizer(recipe.model).pad_token_id if reward else None
        with self._staged_load() if staged else contextlib.nullcontext():
            self.model = build_model(
                recipe.model,
                recipe.memory,
                layout.precision,
                recipe.optim.seed,
                recipe.lora,
                self._load_device(),
                loss_tokens=loss_tokens(self.run),
                head="score" if reward else "lm",
                pad_token_id=pad_id,
            )
        if staged:
            self._partition_staged_base()
        if quantized(recipe.lora):
            assert recipe.lora is not None
            held = WORLD.gather_objects(quantized_base(self.model).held)
            self.say(describe_quantized(self.model, recipe.lora, held))
        mark("model build")
        self.ds = self._prepare(max_steps)
        self.ds.train()  # from_pretrained returns the model in eval mode (dropout off)
        if layout.sp > 1:
            from deepspeed.utils import groups  # the groups `prepare` made for Ulysses

            group = Collectives(groups._get_sequence_parallel_group())
            self._sequence = SequenceShard(layout.sp, layout.sp_rank(int(os.environ["RANK"])), group)
        if notice := compile_notice(recipe.memory):
            self.say(notice)
        self.objective = self._objective()  # a frozen reference is built here, inside zero.Init too
        mark("deepspeed init")
        self._hf_ds_config = None  # zero.Init is done with it

    def _load_device(self) -> str | None:
        """Where pretrained weights load to: this rank's GPU, except under ZeRO-3 (zero.Init partitions them).

        Read onto the GPU tensor by tensor, the host never holds the model (the planner's load
        peak is one checkpoint shard); DeepSpeed would move it there anyway. A 4-bit base under
        ZeRO-3 loads onto the host, whole on each rank, to be partitioned from there (quantised on this
        rank's device as it loads: `_staged_load`, quantized_base.py).
        """
        recipe = self.run.recipe
        if staged_on_host(recipe.lora, self.run.layout.zero_stage):
            return "cpu"
        if not torch.cuda.is_available() or self.run.layout.zero_stage == 3:
            return None
        return f"cuda:{torch.cuda.current_device()}"

    @contextlib.contextmanager
    def _staged_load(self) -> Iterator[None]:
        """While a 4-bit base loads onto the host: transformers without the ZeRO-3 config Accelerate registered,
        and each weight quantised on this rank's device (quantized_base.py `quantizing_on`: one weight on the GPU at
        a time, not bitsandbytes' CPU quantiser, which takes hours for a 70B base).

        transformers refuses a device_map while a ZeRO-3 config is registered (integrations/accelerate.py,
        5.24), and for a quantised model that config changes nothing else (zero.Init is skipped for it);
        without a device_map its bitsandbytes quantizer would load the whole base onto the GPU.
        """
        with without_hf_zero3_config(), quantizing_on(Staging(self.accelerator.device)):
            yield

    def _partition_staged_base(self) -> None:
        """ZeRO-3's partitions of the host-staged 4-bit base, before the engine would move it whole to the GPU.

        `deepspeed.zero.Init(module=...)` partitions an already-built model as if it had been built in the
        context (DeepSpeed's own path for such models, run by the engine only after its `module.to(device)`):
        tensor by tensor, each moved to this rank's device, broadcast from rank 0 and cut, its partition
        kept there or, under offload_param, on the host. The engine then sees a zero.Init model and leaves it
        in place.
        """
        import deepspeed

        release_freed_host_memory()
        place_quantization_state(self.model, self.accelerator.device)
        deepspeed.zero.Init(module=self.model, config_dict_or_path=self.run.ds_config)

    def _prepare(self, max_steps: int) -> Any:
        """The DeepSpeed engine, with the optimizer and LR schedule it steps at each accumulation boundary."""
        from accelerate.utils import DummyOptim, DummyScheduler

        run, model, optim = self.run, self.model, self.run.recipe.optim
        schedule = partial(build_scheduler, optim=optim, max_steps=max_steps)
        if "optimizer" in run.ds_config:
            # A DS JSON with its own optimizer (common in configs written for other tools): DeepSpeed
            # builds it from the resolved values, and our schedule unless the JSON has one too.
            optimizer = DummyOptim(model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
            callable_ = None if "scheduler" in run.ds_config else schedule
            scheduler = DummyScheduler(
                optimizer, max_steps, optim.warmup_steps, lr_scheduler_callable=callable_
            )
            engine, _, _ = self.accelerator.prepare(model, optimizer, scheduler)
            return engine
        optimizer = build_optimizer(model, optim, run.layout.offload_optimizer)
        engine, _ = self.accelerator.prepare(model, optimizer)
        if "scheduler" not in run.ds_config:
            # Accelerate hands DeepSpeed only its own scheduler types; giving the engine ours means it
            # steps the LR exactly at accumulation boundaries, skips it on fp16 overflow, and saves it
            # in its checkpoints. The ZeRO wrappers update the client optimizer's param_groups.
            engine.lr_scheduler = schedule(engine.basic_optimizer)  # the optimizer the engine steps
        return engine

    def _objective(self) -> Objective:
        """The recipe's objective; for DPO with the reference it asks for (see reference.py)."""
        recipe = self.run.recipe
        if self._sequence is not None:  # config/parallel.py refuses every objective but lm under sp > 1
            return SequenceParallelLM(self._sequence.shard, self._sequence.group)
        spec = objective_spec(recipe.objective)
        if spec.generates:
            return Grpo(recipe.grpo, self._grpo_reference() if recipe.grpo.beta else None)
        if spec.references == ("none",):
            return make_objective(recipe)
        unwrapped = self.accelerator.unwrap_model(self.ds)
        # Under LoRA the reference is the base: the policy's own engine with the adapters switched off.
        chunked = recipe.memory.tiled_loss
        own = reference_forward(
            self.ds, unwrapped.disable_adapter if recipe.lora is not None else None, chunked
        )
        if recipe.preference.reference == "cached":
            scorer = CachedReference(
                self.run, own, unwrapped.config, self.run.layout.micro_batch_size, self.ds.device
            )
            return make_objective(recipe, prepare=scorer)
        if recipe.lora is not None:
            return make_objective(recipe, live_reference=own)
        self._reference = frozen_reference(self.run, self._load_device())
        return make_objective(recipe, live_reference=reference_forward(self._reference, chunked=chunked))

    def _grpo_reference(self) -> Callable[[Batch], torch.Tensor]:
        """GRPO's reference for beta > 0, the initial model: under LoRA the policy's own engine with its adapters
        off, else a frozen copy (reference.py), partitioned like the policy under ZeRO-3. Eval mode, no grad."""
        temperature = self.run.recipe.grpo.temperature
        if self.run.recipe.lora is not None:
            model: Any = self.ds
            switch = self.accelerator.unwrap_model(self.ds).disable_adapter
        else:
            self._reference = model = frozen_reference(self.run, self._load_device())
            switch = contextlib.nullcontext

        @torch.no_grad()
        def logps(batch: Batch) -> torch.Tensor:
            module = getattr(model, "module", model)
            was_training = module.training
            model.eval()
            try:
                with switch():
                    return rollout_logps(model, to_device(batch, self.ds.device), temperature)
            finally:
                if was_training:
                    model.train()

        return logps

    def token_flops(self) -> TokenFlops | None:
        return model_token_flops(self.model)

    def _score(self, batch: Batch) -> Scored:
        """The micro-batch scored by the objective (runtime/loss/): the loss to backpropagate, what to log."""
        return self.objective.score(self.ds, to_device(batch, self.ds.device))

    def train_step(self, batches: Iterator[Batch], measure_grad_norm: bool) -> StepResult:
        skip = self.run.recipe.checkpoint.on_nonfinite == "skip"
        scores, grad_norm = [], None
        for _ in range(self.run.layout.grad_accum):
            scored = self._score(next(batches))
            # Skipping must be decided before backward, by all ranks together (one collective per
            # micro-batch), so it is only paid for when asked for.
            while skip and not WORLD.all_finite(scored.loss):
                if self.skipped_microbatches >= MAX_SKIPS:
                    raise NonFiniteLoss(f"non-finite loss: {self.skipped_microbatches} micro-batches skipped")
                self.skipped_microbatches += 1  # dropped before backward: the weights never see it
                scored = self._score(next(batches))
            self.ds.backward(scored.loss)
            if measure_grad_norm and self.ds.is_gradient_accumulation_boundary():
                grad_norm = self._grad_norm_if_untracked()
            self.ds.step()
            scores.append(scored)
        means = mean_scores(scores)
        return StepResult(means.pop("loss"), grad_norm=grad_norm, metrics=means)

    def _grad_norm_if_untracked(self) -> float | None:
        """ZeRO-0 in fp32 clips without keeping the norm: measure it at the boundary, before the step.

        Under AutoTP a rank holds a slice of each replaced weight (DeepSpeed marks those
        `tensor_model_parallel`) and a whole copy of the rest: the slices' squares are summed over
        the tensor-parallel group, the copies counted once.
        """
        ds = self.ds
        if ds.zero_optimization_stage() != 0 or ds.bfloat16_enabled() or ds.fp16_enabled():
            return None
        sliced, whole = torch.zeros((), device=ds.device), torch.zeros((), device=ds.device)
        tp = False
        for param in ds.module.parameters():
            if param.grad is None:
                continue
            square = param.grad.detach().float().pow(2).sum()
            if getattr(param, "tensor_model_parallel", False):
                sliced += square
                tp = True
            else:
                whole += square
        if tp:
            from deepspeed.utils import groups

            sliced = Collectives(groups.get_tensor_model_parallel_group()).sum(sliced)
        return float((sliced + whole).sqrt())

    def grad_norm(self) -> float | None:
        tracked = self.ds.get_global_grad_norm()
        return float(tracked) if tracked is not None else None

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> dict[str, float]:
        if not batches:
            return {"eval_loss": float("nan")}
        if self._sequence is not None:
            with evaluating(self.ds.module):  # sharded like training: SequenceParallelLM
                scores = [self._score(b) for b in batches]
        else:
            self.ds.eval()
            scores = [self._score(b) for b in batches]
            self.ds.train()
        return self.objective.eval_summary(WORLD.means(mean_scores(scores)))

    def export(self, final: Path, tokenizer: PreTrainedTokenizerBase) -> None:
        lora = self.run.recipe.lora
        # The reference for the export check: the trained model's logits on a fixed batch, from
        # the engine itself, before anything is written. A collective like the gather below:
        # under ZeRO-3 each layer's shards are gathered from every rank for the forward.
        reference = self.reference_logits(tokenizer)
        release_moments(self.ds.optimizer)  # the run is over: room for the gathered copy below
        if lora is not None and is_peft_model(self.accelerator.unwrap_model(self.ds)):
            self._export_lora(final, tokenizer, reference)
            return
        # Every rank takes part in gathering ZeRO-3 shards; rank 0 writes, alone and with nobody
        # waiting for it: at 70B that is ~140 GB of safetensors, far beyond a collective's timeout,
        # and nothing the other ranks do next needs final/ (they tear the world down and exit; rank 0
        # verifies final/ after that).
        state_dict = self.accelerator.get_state_dict(self.ds)
        if self.accelerator.is_main_process:
            save_hf_model(self.accelerator.unwrap_model(self.ds), state_dict, tokenizer, final)
            write_reference(final, *reference)

    @torch.no_grad()
    def _export_lora(
        self, final: Path, tokenizer: PreTrainedTokenizerBase, reference: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """LoRA / QLoRA: merged weights written shard by shard from the GPU, or the adapter alone."""
        model = self.accelerator.unwrap_model(self.ds)
        gather = self._gather if self.run.layout.zero_stage == 3 else no_gather
        write = self.accelerator.is_main_process
        lora = self.run.recipe.lora
        assert lora is not None
        if lora.export == "adapter":
            write_adapter(model, final, tokenizer, gather, write)
        else:
            dtype = EXPORT_DTYPES[self.run.layout.precision]
            peak = write_merged(model, final, tokenizer, gather, dtype, write)
            if write:
                self.say(f"export: merged shard by shard, host peak {peak / 2**30:.2f} GiB")
        if write:
            # Merged: what verify_export compares the reloaded model with. Adapter: the logits the
            # base plus this adapter must give when reloaded with PEFT (lora.verify_adapter_export
            # checks the files' shapes; reloading needs the user's base model).
            write_reference(final, *reference)
        # No barrier after the last shard, as for a full export: nothing the other ranks do next needs
        # final/. Between ZeRO-3's per-module gathers rank 0 writes at most one shard (EXPORT_SHARD_BYTES)
        # while the others wait in the next gather: seconds, far inside the process group's timeout.

    @contextlib.contextmanager
    def benchmark_model(self) -> Iterator[Any]:
        """The live model for rank 0's benchmark: itself under ZeRO-0..2, a gathered copy under ZeRO-3.

        ZeRO-0..2 keep the whole model on every rank: rank 0 evaluates it in place, in eval mode (no
        dropout), with no gradient, and hands it back in train mode. Under ZeRO-3 a forward on one rank
        would wait on the others' shards, so the weights are gathered as the export gathers them
        (`get_state_dict`: every rank takes part, rank 0 holds the result on the host) into a plain copy
        built on rank 0 (a PEFT model again for LoRA), freed on exit.
        """
        unwrapped = self.accelerator.unwrap_model(self.ds)
        main = self.accelerator.is_main_process
        if self.run.layout.zero_stage != 3:
            unwrapped.eval()
            try:
                with torch.no_grad():
                    yield unwrapped if main else None
            finally:
                unwrapped.train()
            return
        state_dict = self.accelerator.get_state_dict(self.ds)
        copy = self._plain_copy(unwrapped, state_dict) if main else None
        del state_dict
        try:
            with torch.no_grad():
                yield copy
        finally:
            del copy

    def _plain_copy(self, unwrapped: Any, state_dict: dict[str, torch.Tensor]) -> Any:
        """A model without ZeRO-3's partitioning, holding `state_dict`, on this rank's device."""
        with without_hf_zero3_config():  # else transformers would build it partitioned, under zero.Init
            dtype = next(iter(state_dict.values())).dtype
            model = model_class(unwrapped.config).from_config(unwrapped.config, dtype=dtype)
            if is_peft_model(unwrapped):
                assert self.run.recipe.lora is not None
                model = apply_lora(model, self.run.recipe.lora)
        model.load_state_dict(state_dict, strict=True)
        return model.to(self.ds.device).eval()

    @staticmethod
    def _gather(params: list[torch.nn.Parameter]) -> AbstractContextManager[Any]:
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    @torch.no_grad()
    def reference_logits(self, tokenizer: PreTrainedTokenizerBase) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, logits) of the model as it trained; eval mode, since the reload runs without dropout."""
        # Through the text config: an image-text model's top-level config has no vocab_size (Gemma 3).
        config = self.accelerator.unwrap_model(self.ds).config.get_text_config()
        input_ids = reference_input_ids(tokenizer, config.vocab_size)
        self.ds.eval()
        logits = self.ds(input_ids=input_ids.to(self.ds.device)).logits
        self.ds.train()
        if self.run.layout.tp > 1 and logits.shape[-1] != config.vocab_size:
            # AutoTP splits the output layer over the vocabulary: each rank of a tensor-parallel group
            # holds its slice of the logits, in the group's rank order.
            from deepspeed.utils import groups

            tp = Collectives(groups.get_tensor_model_parallel_group())
            logits = torch.cat(tp.gather_objects(logits.detach().cpu()), dim=-1)
        return input_ids, logits

    def finish(self) -> None:
        if self.accelerator is not None:
            self.accelerator.end_training()

        destroy()
        # Checked the way a user loads it afterwards: plain transformers, no ZeRO-3 context (which
        # would try to partition the skeleton across a world that has just been torn down).
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
