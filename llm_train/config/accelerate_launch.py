"""The user's accelerate config: what an `accelerate launch` (its flags and config file) says about a run.

Most Accelerate users already have a config file (`accelerate config` writes one, often as their
default). It says *where* processes run, and it may also say *what* (a DeepSpeed plugin's
`zero_stage`, offload devices, accumulation, `mixed_precision`, a `deepspeed_config_file`). Handed to
Accelerate as they are, these collide with the recipe: a DS plugin with a config file fails inside
Accelerate ("When using `deepspeed_config_file`, the following accelerate config variables will be
ignored", accelerate 1.15 dataclasses.py `_deepspeed_config_checks`), and a MULTI_CPU config's
`ACCELERATE_USE_CPU` made Accelerate skip DeepSpeed's process group, so DeepSpeed counted a world of 1
("train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 16 != 8 * 1 * 1").

So every value is reconciled here, once, before the run is resolved, by one rule:

- `deepspeed_config_file` stands for `--ds-config` (train.py's flag wins when both are given);
- `zero_stage`, the offload devices, `gradient_accumulation_steps`, `gradient_clipping`,
  `mixed_precision` and `dynamo_backend` (a config's `dynamo_config`) map onto the recipe's settings
  (its DeepSpeed JSON, optim.grad_accum, optim.grad_clip, precision, memory.torch_compile); where they
  differ, the recipe wins (it was planned to fit; the engine hands Accelerate its own dynamo plugin,
  runtime/model/fast.py);
- `reconcile` writes one start-up notice naming, for every such value, what won and where each
  came from; the workers then never see Accelerate's own copy of them (runtime/base/launch_env.py clears it);
- a kind llm_train cannot train under (FSDP, Megatron-LM, TPU, mpirun) is one line before any
  worker starts (`refuse`).

No accelerate import here: runtime/base/launch_env.py reads the command line with Accelerate's own parser
and hands this module plain values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llm_train.errors import UserError

if TYPE_CHECKING:
    from llm_train.config.resolution import Resolved

ENV = "LLM_TRAIN_ACCELERATE_LAUNCH"  # the first process's reading, handed to the workers it starts

# accelerate's DistributedType values llm_train runs under (DeepSpeed is always what trains).
RUNS_UNDER = ("NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED")
_REFUSED = {
    "FSDP": "llm_train shards with DeepSpeed ZeRO (ZeRO-3 is what FSDP does); use distributed_type "
    "MULTI_GPU or DEEPSPEED, or no accelerate config, and pick the stage in the recipe's deepspeed.config",
    "MEGATRON_LM": "llm_train splits models with DeepSpeed (tensor/pipeline degrees in the recipe); use "
    "distributed_type MULTI_GPU or DEEPSPEED",
    "XLA": "llm_train trains through DeepSpeed, which has no TPU backend; use a GPU or CPU machine",
}
# The accelerate fields (config-file keys and `accelerate launch` flags alike) that say *what* is trained.
FIELDS = (
    "deepspeed_config_file",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_optimizer_nvme_path",
    "offload_param_nvme_path",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "mixed_precision",
    "zero3_init_flag",
    "zero3_save_16bit_model",
    "dynamo_backend",
)
_PRECISION = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}  # accelerate's names -> the recipe's


@dataclass(frozen=True)
class AccelerateLaunch:
    """The what-fields of one `accelerate launch`, each with where it came from."""

    kind: str  # accelerate's distributed_type: NO, MULTI_CPU, MULTI_GPU, DEEPSPEED, FSDP, ...
    values: dict[str, str] = field(default_factory=dict)  # FIELDS given, as accelerate holds them
    origins: dict[str, str] = field(
        default_factory=dict
    )  # "accelerate config PATH" / "accelerate launch --x"
    mpirun: bool = False  # the config asks accelerate to start the CPU processes with mpirun

    def to_json(self) -> str:
        return json.dumps(
            {"kind": self.kind, "values": self.values, "origins": self.origins, "mpirun": self.mpirun}
        )

    @classmethod
    def from_json(cls, text: str) -> AccelerateLaunch:
        data = json.loads(text)
        return cls(data["kind"], data["values"], data["origins"], data["mpirun"])


def refuse(launch: AccelerateLaunch | None) -> None:
    """One line for an accelerate config llm_train cannot train under; nothing for the others."""
    if launch is None:
        return
    if launch.kind in _REFUSED:
        raise UserError(f"accelerate distributed_type {launch.kind}: {_REFUSED[launch.kind]}")
    if launch.kind not in RUNS_UNDER and not launch.kind.startswith("MULTI_"):
        raise UserError(
            f"accelerate distributed_type {launch.kind}: llm_train runs under NO, MULTI_CPU, MULTI_GPU "
            "or DEEPSPEED; run `accelerate config` again and pick one of those"
        )
    if launch.mpirun:
        raise UserError(
            "accelerate config mpirun_config.mpirun_hostfile: llm_train starts its CPU workers itself "
            "(gloo, one world); remove mpirun_hostfile, or launch each node with --machine_rank"
        )


def ds_config(launch: AccelerateLaunch | None, flag: str | None) -> str | None:
    """The DeepSpeed JSON this launch names: train.py's --ds-config, else the config's deepspeed_config_file."""
    if flag is not None or launch is None:
        return flag
    return launch.values.get("deepspeed_config_file")


def reconcile(launch: AccelerateLaunch | None, run: Resolved, ds_flag: str | None) -> str | None:
    """The start-up notice: each what-field of the launch, the value the run trains with, and where each is from.

    `a -> b`: accelerate's `a` is overridden by the recipe's `b`; `a = b`: they agree. Grouped by
    origin (the config file, `accelerate launch` flags), so the notice stays one line.
    """
    if launch is None or not launch.values:
        return None
    layout, recipe = run.layout, run.recipe
    json_name = run.ds_path.name
    given = launch.values
    said: dict[str, list[str]] = {}

    def note(name: str, text: str) -> None:
        said.setdefault(launch.origins[name], []).append(text)

    if "deepspeed_config_file" in given:
        path = given["deepspeed_config_file"]
        if ds_flag is not None:
            note("deepspeed_config_file", f"deepspeed_config_file {path} -> --ds-config {ds_flag}")
        else:
            note(
                "deepspeed_config_file",
                f"deepspeed_config_file {path} = the run's DeepSpeed JSON (as --ds-config)",
            )
    # The recipe's value for each mapped field, and where the recipe has it.
    ours: dict[str, tuple[str, str]] = {
        "zero_stage": (str(layout.zero_stage), f"{json_name} zero_optimization.stage"),
        "offload_optimizer_device": (layout.offload_optimizer, f"{json_name} offload_optimizer"),
        "offload_param_device": (layout.offload_params, f"{json_name} offload_param"),
        "offload_optimizer_nvme_path": (str(recipe.deepspeed.nvme_path), "deepspeed.nvme_path"),
        "offload_param_nvme_path": (str(recipe.deepspeed.nvme_path), "deepspeed.nvme_path"),
        "gradient_accumulation_steps": (str(layout.grad_accum), "optim.grad_accum"),
        "gradient_clipping": (_number(recipe.optim.grad_clip), "optim.grad_clip"),
        "mixed_precision": (layout.precision, "precision"),
        "zero3_init_flag": (
            "true" if layout.zero_stage == 3 else "false",
            "weights are created partitioned exactly when ZeRO-3 trains",
        ),
        "zero3_save_16bit_model": ("true", "final/ and `llm-train export` gather 16-bit weights"),
        # What fast.dynamo_plugin hands Accelerate: inductor for `model` and `layers`, no for `off`.
        "dynamo_backend": (
            "NO" if recipe.memory.torch_compile == "off" else "INDUCTOR",
            f"memory.torch_compile={recipe.memory.torch_compile}",
        ),
    }
    for name, (value, where) in ours.items():
        if name in given:
            sign = "=" if _theirs(name, given[name]) == value else "->"
            note(name, f"{name} {given[name]} {sign} {value} ({where})")
    groups = [f"{origin}: {', '.join(texts)}" for origin, texts in said.items()]
    return "accelerate settings as this run trains them (a -> b: the recipe's b wins): " + "; ".join(groups)


def _theirs(name: str, value: str) -> str:
    """An accelerate value in the recipe's terms, so that equal settings compare equal."""
    if name == "mixed_precision":
        return _PRECISION.get(value.lower(), value)
    if name == "gradient_clipping":
        try:
            return _number(float(value))
        except ValueError:
            return value
    if name in ("zero3_init_flag", "zero3_save_16bit_model"):
        return value.lower()
    if name == "dynamo_backend":
        return value.upper()
    return value


def _number(value: float) -> str:
    return f"{value:g}"
