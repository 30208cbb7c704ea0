"""The recipe: a strict, typed description of *what* is trained.

A recipe is one YAML file in `recipes/` (or any path). It is loaded, overridden with
`key.sub=value` arguments that use the recipe's own names, and validated here; nothing
downstream ever sees an unknown key or a missing value read as None. *How* the run is
distributed lives in the DeepSpeed JSON the recipe names (see ds_json.py).

This module is the schema's top: `Recipe`, the checks across its sections (which objective trains on
which data format, and what it cannot be combined with) and `load_recipe`. The parts sit beside it:
recipe_sections.py (hardware, model, data, optim, memory, LoRA, DeepSpeed, eval, output, checkpoint,
tracking), source_schema.py (the data formats' keys), objective_sections.py (preference, reward model, GRPO
and its rewards), section.py (their strict base), and recipe_files.py, which reads the file, applies the
overrides and anchors paths before this module validates the result. Nothing is re-exported here:
every name is imported from the module that defines it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from llm_train.config.objective_sections import (
    DEFAULT_BETA,
    GrpoSection,
    Objective,
    PreferenceSection,
    RewardSection,
)
from llm_train.config.objectives import objective_spec
from llm_train.config.recipe_files import (
    apply_overrides,
    describe_validation_error,
    find_recipe,
    read_recipe_file,
)
from llm_train.config.recipe_sections import (
    CheckpointSection,
    DataSection,
    DeepSpeedSection,
    EvalSection,
    HardwareSection,
    LoraSection,
    MemorySection,
    ModelSection,
    OptimSection,
    OutputSection,
    TrackingSection,
)
from llm_train.config.section import Section
from llm_train.config.source_schema import Source
from llm_train.errors import UserError


class Recipe(Section):
    """One training recipe: what is trained, on which data, with which optimiser and precision."""

    name: str = Field(description="Recipe name (defaults to the YAML file's stem).")
    description: str = Field("", description="One line: what this recipe trains.")
    hardware: HardwareSection = Field(default_factory=HardwareSection)
    model: ModelSection
    data: DataSection
    optim: OptimSection
    precision: Literal["bf16", "fp16", "fp32", "auto"] = Field(
        "auto", description="'auto' = bf16 where supported, fp16 on older GPUs, fp32 on CPU."
    )
    memory: MemorySection = Field(default_factory=MemorySection)
    lora: LoraSection | None = Field(
        None, description="Train LoRA adapters instead of all weights (needs peft)."
    )
    objective: Objective = Field(
        "lm",
        description="'lm': next-token cross-entropy on the loss mask (pre-training, SFT); 'dpo': DPO's "
        "sigmoid loss against a reference model; 'simpo': SimPO, reference-free (both need "
        "format: preference data); 'grpo': online RL, the model's own completions scored by rewards "
        "(format: prompt data); 'reward': a reward model (a one-output sequence-classification head on the "
        "model) trained on format: preference pairs with the Bradley-Terry loss, exported as "
        "AutoModelForSequenceClassification.",
    )
    preference: PreferenceSection = Field(
        default_factory=PreferenceSection, description="DPO / SimPO settings (objective dpo or simpo)."
    )
    grpo: GrpoSection = Field(
        default_factory=GrpoSection, description="GRPO settings (objective grpo): generation, loss, rewards."
    )
    reward: RewardSection = Field(
        default_factory=RewardSection,
        description="Reward-model settings (objective reward): margin, centring.",
    )
    deepspeed: DeepSpeedSection
    eval: EvalSection = Field(default_factory=EvalSection)
    output: OutputSection = Field(default_factory=OutputSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)

    @model_validator(mode="after")
    def _combinations(self) -> Recipe:
        if self.memory.attention == "flash_attention_2" and self.hardware.device == "cpu":
            raise ValueError(
                "memory.attention=flash_attention_2 needs a CUDA GPU; use sdpa on hardware.device=cpu"
            )
        if self.memory.attention in ("flex_attention", "sdpa_flex") and self.hardware.device == "cpu":
            raise ValueError(
                f"memory.attention={self.memory.attention} cannot train on CPU (torch has no flex_attention "
                "backward there); use sdpa or auto on hardware.device=cpu"
            )
        if self.lora is not None and self.lora.quantize != "none" and self.model.init == "random":
            # bitsandbytes quantises weights as transformers loads them from a checkpoint.
            raise ValueError(
                f"lora.quantize={self.lora.quantize} quantises a pretrained base as it loads; it needs "
                "model.init=pretrained (save a randomly initialised model with save_pretrained first, and point "
                "model.name_or_path at that directory)"
            )
        if self.optim.max_steps is None and any(
            not isinstance(s, str) and s.streaming for s in self.data.train
        ):
            raise ValueError(
                "data.train is streamed (streaming: true), so its length is unknown and optim.epochs cannot be "
                "counted; set optim.max_steps"
            )
        self._check_objective()
        return self

    def _check_objective(self) -> None:
        """Preference data and preference objectives come together; what pairs cannot use is refused."""
        objective, preference = self.objective, self.preference
        spec = objective_spec(objective)
        sources = [
            (f"data.{split}[{i}]", source)
            for split in ("train", "eval")
            for i, source in enumerate(self.data.sources(split))
        ]
        if not spec.generates:
            _refuse_formats_of(sources, "grpo", objective)
            changed = [k for k, v in GrpoSection().model_dump().items() if getattr(self.grpo, k) != v]
            if changed:
                raise ValueError(
                    f"grpo.{changed[0]} is set but objective is {objective}; set objective: grpo, or remove the "
                    "grpo section"
                )
        else:
            self._check_grpo()
            return
        if spec.section != "reward":
            changed = [k for k, v in RewardSection().model_dump().items() if getattr(self.reward, k) != v]
            if changed:
                raise ValueError(
                    f"reward.{changed[0]} is set but objective is {objective}; set objective: reward, or remove "
                    "the reward section"
                )
        if spec.section is None:
            _refuse_formats_of(sources, "dpo", objective)
            # Compared with the defaults, not with what was written: a dumped recipe lists every field.
            changed = [k for k, v in PreferenceSection().model_dump().items() if getattr(preference, k) != v]
            if changed:
                raise ValueError(
                    f"preference.{changed[0]} is set but objective is lm; set objective: dpo (or simpo), or "
                    "remove the preference section"
                )
            return
        for key, source in sources:
            if objective not in source.objectives:
                raise ValueError(
                    f"{key} is format {source.format}, but objective={objective} trains on pairs; give every data.train "
                    "and data.eval source format: preference (prompt, chosen, rejected)"
                )
            if source.streaming:
                raise ValueError(
                    f"{key}.streaming=true: preference pairs are tokenised up front (the reference pass reads "
                    "them all before training); remove streaming"
                )
        if self.data.packing == "packed":
            raise ValueError(
                f"objective={objective} trains each pair as two padded rows (chosen and rejected); set "
                "data.packing=padded"
            )
        if spec.section == "reward":
            self._check_reward()
            return
        defaults = PreferenceSection()
        if "reference" not in spec.own_keys and preference.reference != defaults.reference:
            raise ValueError(
                "preference.reference=live applies to objective dpo; simpo is reference-free: remove "
                "preference.reference"
            )
        if "simpo_gamma" not in spec.own_keys and preference.simpo_gamma != defaults.simpo_gamma:
            raise ValueError(
                "preference.simpo_gamma applies to objective simpo; remove it or set objective: simpo"
            )
        if preference.beta is None:
            # Filled in here so the resolved recipe (config/recipe.yaml, W&B) shows the beta that trains.
            preference.beta = DEFAULT_BETA[objective]

    def _check_reward(self) -> None:
        """A reward model reads the pairs DPO reads, but has a score head instead of an LM head."""
        changed = [k for k, v in PreferenceSection().model_dump().items() if getattr(self.preference, k) != v]
        if changed:
            raise ValueError(
                f"preference.{changed[0]} applies to objective dpo or simpo; remove it (objective reward is set "
                "in the reward section: margin, center_rewards_coefficient)"
            )
        if self.lora is not None:
            raise ValueError(
                "lora: objective reward trains the whole model and its new score head (LoRA on a reward model is "
                "not supported yet); remove the lora section"
            )
        if self.memory.tiled_loss:
            raise ValueError("memory.tiled_loss applies to the token loss; remove it with objective reward")

    def _check_grpo(self) -> None:
        """Prompts in, completions generated: every source is a prompt source, and a completion fits seq_len."""
        grpo = self.grpo
        changed = [k for k, v in PreferenceSection().model_dump().items() if getattr(self.preference, k) != v]
        if changed:
            raise ValueError(
                f"preference.{changed[0]} is set but objective is grpo; remove the preference section (grpo.beta "
                "weighs the KL to the initial model)"
            )
        changed = [k for k, v in RewardSection().model_dump().items() if getattr(self.reward, k) != v]
        if changed:
            raise ValueError(
                f"reward.{changed[0]} is set but objective is grpo; the reward section trains a reward model "
                "(objective reward): remove it, and score GRPO's completions with grpo.rewards (a trained one: "
                "{kind: reward_model, path: ...})"
            )
        for split in ("train", "eval"):
            for i, source in enumerate(self.data.sources(split)):
                if split == "eval":
                    raise ValueError(
                        f"data.eval[{i}]: objective grpo has no evaluation set (its metrics are the rewards of "
                        "each step); remove data.eval and set data.eval_fraction=0"
                    )
                if "grpo" not in source.objectives:
                    raise ValueError(
                        f"data.train[{i}] is format {source.format}, but objective=grpo generates from prompts; give every "
                        "data.train source format: prompt (a prompt field and the fields your rewards read)"
                    )
                if source.streaming:
                    raise ValueError(
                        f"data.train[{i}].streaming=true: prompts are read whole; remove streaming"
                    )
        if self.data.eval_fraction > 0:
            raise ValueError(
                f"data.eval_fraction={self.data.eval_fraction}: objective grpo has no evaluation set (its metrics "
                "are the rewards of each step); set data.eval_fraction=0"
            )
        if not grpo.rewards:
            raise ValueError(
                "grpo.rewards is empty; give at least one reward, e.g. [{kind: format, pattern: '...'}]"
            )
        if grpo.max_completion_length >= self.data.seq_len:
            raise ValueError(
                f"grpo.max_completion_length={grpo.max_completion_length} leaves no room for a prompt in "
                f"data.seq_len={self.data.seq_len} (prompt + completion); raise data.seq_len or lower it"
            )
        if self.memory.tiled_loss:
            raise ValueError("memory.tiled_loss applies to the token loss; remove it with objective grpo")
        if self.deepspeed.pipeline_stages > 1:
            # Before the layout's own rule (pipelines need ZeRO-0/1), whose fix would only lead here.
            raise ValueError(
                f"deepspeed.pipeline_stages={self.deepspeed.pipeline_stages}: objective grpo generates with the "
                "whole model on each rank, which DeepSpeed's pipeline engine never runs; use ZeRO data "
                "parallelism: deepspeed.pipeline_stages=1 with deepspeed.config=zero2 (zero3, or zero3_offload, "
                "for a model that one GPU cannot hold)"
            )

    @property
    def sequences_per_sample(self) -> int:
        """Sequences one sample trains: two for a preference pair (chosen and rejected), else one."""
        return objective_spec(self.objective).sequences_per_sample

    @property
    def output_dir(self) -> Path:
        return Path(self.output.dir.replace("{name}", self.name))


# What a format reserved for other objectives trains with, by an objective that reads it.
_TRAINS_WITH = {
    "grpo": "online RL; set objective: grpo",
    "dpo": "a preference objective; set objective: dpo (or simpo)",
}


def _refuse_formats_of(sources: list[tuple[str, Source]], reader: Objective, objective: Objective) -> None:
    """The first source whose format `reader` trains on and `objective` does not, refused in one line."""
    for key, source in sources:
        if reader in source.objectives and objective not in source.objectives:
            raise ValueError(
                f"{key} is format {source.format}, which trains with {_TRAINS_WITH[reader]}, or use another format"
            )


def load_recipe(name_or_path: str, overrides: list[str] | None = None) -> Recipe:
    """Load, override and validate a recipe; every problem is a one-line UserError."""
    path = find_recipe(name_or_path)
    return recipe_from_data(read_recipe_file(path), overrides, f"recipe {path.name}")


def recipe_from_data(data: dict[str, Any], overrides: list[str] | None, source: str) -> Recipe:
    """A recipe from its mapping (paths anchored) and overrides, validated; `source` names it in errors."""
    apply_overrides(data, overrides)
    source = source if not overrides else f"{source} (with overrides)"
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, Recipe, source)) from None


def recipe_to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
