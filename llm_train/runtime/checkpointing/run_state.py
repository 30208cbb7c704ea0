"""A run's state in a checkpoint: what each rank writes beside DeepSpeed's, and the `Saver` that commits it.

DeepSpeed's engine checkpoint carries the model, optimizer and LR schedule; next to it each
rank writes a small JSON file (no pickle) with the step, its data position, its RNG states, the
digest of its fp32 masters (master_digest.py), the LoRA base's identity and the tracker's run id, and
rank 0 writes the
HF config, the tokenizer, the recipe and the live model's logits on the export check's batch, so
an export needs nothing else.

A LoRA (or QLoRA) checkpoint holds the adapters, not the frozen base they were trained on: the base
is loaded again from model.name_or_path at every start. So each checkpoint records the base's
identity (`base_identity`: the hub commit it resolves to in the local cache, or a digest of the
directory's config and weight index / safetensors headers, or the seed and config of a random one),
and a resume onto another base is refused in one line unless --allow-base-change says so. How the directory is committed, verified and listed is commit.py's;
how the state comes back is resume.py's.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from llm_train.config.recipe import Recipe, recipe_to_yaml
from llm_train.config.resolution import Resolved
from llm_train.errors import UserError
from llm_train.runtime.base import collectives
from llm_train.runtime.checkpointing.commit import (
    CHECKPOINT_REFERENCE,
    DS_TAG,
    Checkpointer,
    SaveMeta,
    committed,
    dir_size,
)
from llm_train.runtime.checkpointing.control import RunControl
from llm_train.runtime.checkpointing.logit_reference import write_reference_file
from llm_train.runtime.checkpointing.master_digest import DIGEST_KEY, live_master_digest
from llm_train.runtime.checkpointing.universal import universal_dir
from llm_train.runtime.model.processor_files import copy_processor_files, model_processor_sources

if TYPE_CHECKING:
    import torch
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase

    from llm_train.data.dealer import Batches
    from llm_train.observability.tracking import Trackers

Say = Callable[[str], None]


class Saved(Protocol):
    """What a save needs of the run's engine (runtime/engines/engine.py `Engine` has both): checkpointing sits
    below the engines, so it names only these two."""

    ds: DeepSpeedEngine

    def reference_logits(self, tokenizer: PreTrainedTokenizerBase) -> tuple[torch.Tensor, torch.Tensor]: ...


def trainer_state_path(ckpt_dir: Path, rank: int) -> Path:
    return ckpt_dir / "trainer" / f"rank{rank:05d}.json"


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and CUDA) RNG states as JSON (loaded without pickle)."""
    import random

    import numpy as np
    import torch

    # The legacy tuple form (numpy types get_state() as that tuple or a dict, by its `legacy` flag).
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)
    state: dict[str, Any] = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        # This rank's device only: get_rng_state_all() would create a CUDA context on every GPU
        # of the node from every rank (hundreds of MiB each, on GPUs other ranks are filling).
        state["cuda_device"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda_device" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda_device"], dtype=torch.uint8))


def reseed(seed: int, step: int, rank: int) -> None:
    """Python, NumPy and torch RNGs from (seed, step, rank): a resumed rank with no saved state of its own."""
    import random

    import numpy as np
    import torch

    mixed = int(np.random.SeedSequence([seed & 0xFFFF_FFFF, step, rank]).generate_state(1)[0])
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)  # seeds the CUDA generators too


def recipe_hash(recipe: Recipe) -> str:
    """What was trained, how: output location, checkpoint cadence and tracking do not count."""
    what = recipe.model_dump(mode="json", exclude={"output", "checkpoint", "tracking"})
    what["optim"].pop("grad_accum")  # the batch is compared on its own, through the layout (`bridge`)
    what["deepspeed"].pop("timeout_minutes")  # how long ranks wait for each other: not what is trained
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


# ------------------------------------------------------------ saving


def checkpoint_bytes_estimate(engine: DeepSpeedEngine, root: Path) -> int:
    """The size of the previous checkpoint, or 16 bytes per parameter (fp32 weights + Adam m, v + slack)."""
    previous = committed(root)
    if previous:
        converted = universal_dir(previous[0])  # a resume's universal copy is not part of the next save
        return dir_size(previous[0]) - (dir_size(converted) if converted.is_dir() else 0)
    # Frozen weights (a LoRA base) are not saved (Saver.commit).
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters() if p.requires_grad)
    return 16 * numel


def base_identity(recipe: Recipe) -> dict[str, Any] | None:
    """What identifies a LoRA run's frozen base (module docstring); None without LoRA.

    Read from files, without loading the model: a directory's config.json and weight index, each safetensors
    file's size and header (names, dtypes, shapes); a hub id's commit as
    the local cache resolves model.revision (huggingface_hub's snapshot folder is named by it); a random
    base's seed and config.
    """
    if recipe.lora is None:
        return None
    model = recipe.model
    if model.init == "random":
        config = json.dumps(model.config, sort_keys=True)
        return {
            "init": "random",
            "seed": recipe.optim.seed,
            "config": hashlib.sha256(config.encode()).hexdigest()[:16],
        }
    name = str(model.name_or_path)
    local = Path(name).expanduser()
    if local.is_dir():
        digest = hashlib.sha256()
        for path in sorted(local.glob("*.json")) + sorted(local.glob("*.safetensors")):
            if path.name == "config.json" or path.name.endswith(".index.json"):
                digest.update(path.name.encode() + path.read_bytes())
            elif path.suffix == ".safetensors":
                with path.open(
                    "rb"
                ) as handle:  # the header: 8 bytes of length, then JSON (dtypes, shapes, offsets)
                    size = int.from_bytes(handle.read(8), "little")
                    digest.update(path.name.encode() + str(path.stat().st_size).encode() + handle.read(size))
        return {"name_or_path": name, "digest": digest.hexdigest()[:16]}
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json", revision=model.revision)
    except ImportError:
        cached = None
    commit = Path(cached).parent.name if isinstance(cached, str) else None
    return {"name_or_path": name, "revision": commit or model.revision}


def check_base(saved: dict[str, Any] | None, now: dict[str, Any] | None, ckpt: str, allow: bool) -> None:
    """A LoRA resume onto another base than its checkpoint's: one line (unless --allow-base-change)."""
    if saved is None or now is None or saved == now or allow:
        return
    what = ", ".join(
        f"{k} {saved.get(k)} -> {now.get(k)}"
        for k in sorted(set(saved) | set(now))
        if saved.get(k) != now.get(k)
    )
    raise UserError(
        f"--resume: checkpoint {ckpt} trained LoRA adapters on another base model ({what}); the adapters only "
        "fit the base they were trained on: point model.name_or_path (and model.revision) at that base, or pass "
        "--allow-base-change to continue on this one"
    )


class Saver:
    """The `save(step)` the training loops call: commit a checkpoint, reset the time cadence, report.

    Every rank calls it at the same step. Before each save it takes the live model's logits on the
    export check's batch (`engine.reference_logits`: a forward of 16 tokens, the collective a ZeRO-3
    forward is), which `llm-train export` verifies its merged weights against.
    """

    def __init__(
        self,
        run: Resolved,
        rank: int,
        engine: Saved,
        batches: Batches,
        tokenizer: PreTrainedTokenizerBase,
        tracker: Trackers,
        control: RunControl,
        say: Say,
    ) -> None:
        recipe = run.recipe
        self.run, self.rank, self.engine, self.batches, self.tokenizer = run, rank, engine, batches, tokenizer
        self.tracker, self.control, self.say = tracker, control, say
        self.checkpointer = Checkpointer(
            recipe.output_dir / "checkpoints",
            rank,
            recipe.checkpoint.keep_last_n,
            collectives.WORLD,
            patience_s=recipe.deepspeed.timeout_minutes * 60,
        )
        # The base this run loaded, read once (a local one: its config, index and every shard's header).
        self.base = base_identity(recipe)

    def __call__(self, step: int) -> None:
        started = time.perf_counter()
        path = self.commit(step)
        self.control.saved()
        self.say(f"checkpoint {path.name} committed in {time.perf_counter() - started:.1f}s")

    def commit(self, step: int) -> Path:
        """Write and commit the checkpoint of `step` (commit.py's protocol); its directory."""
        engine, recipe, layout, rank = self.engine.ds, self.run.recipe, self.run.layout, self.rank
        reference = self.engine.reference_logits(self.tokenizer)
        extra = {"tracker_run_id": self.tracker.run_id}  # W&B continues the same run after a resume

        def write(tmp: Path) -> None:
            # LoRA: the frozen base is the one the run loads from model.name_or_path (seeded or
            # pretrained, identical at every start), so only the adapters and their optimizer are saved:
            # no 16-bit copy of the whole model through host RAM at every checkpoint (15 GiB for an 8B).
            engine.save_checkpoint(
                str(tmp / "state"),
                tag=DS_TAG,
                save_latest=False,
                exclude_frozen_parameters=recipe.lora is not None,
            )
            state_file = trainer_state_path(tmp, rank)
            state_file.parent.mkdir(parents=True, exist_ok=True)
            # The fp32 masters as this rank holds them, for the export's stale-shard check (master_digest.py).
            digest = live_master_digest(engine.optimizer, layout.offload_optimizer == "nvme")
            data = self.batches.state_dict()
            state = {
                "step": step,
                "data": data,
                "rng": rng_state(),
                "base": self.base,
                DIGEST_KEY: digest,
                **extra,
            }
            state_file.write_text(json.dumps(state))
            if rank == 0:
                engine.module.config.save_pretrained(tmp / "hf")
                self.tokenizer.save_pretrained(tmp / "hf")
                # An image-text model's processor files, so `llm-train export` of this checkpoint has them too.
                copy_processor_files(
                    model_processor_sources(
                        recipe.model.name_or_path, recipe.model.revision, recipe.model.tokenizer
                    ),
                    tmp / "hf",
                )
                (tmp / "hf" / "recipe.yaml").write_text(recipe_to_yaml(recipe))
                write_reference_file(tmp / CHECKPOINT_REFERENCE, *reference)

        meta = SaveMeta(
            step, layout.world_size, recipe_hash(recipe), engine.zero_optimization_stage(), layout.as_dict()
        )
        return self.checkpointer.save(meta, write, checkpoint_bytes_estimate(engine, self.checkpointer.root))


def read_data_state(ckpt: Path) -> dict[str, Any]:
    """The checkpoint's data position: the global count of sequences consumed, the same in every rank's file."""
    return json.loads(trainer_state_path(ckpt, 0).read_text())["data"]
