"""DPO's reference model without a second copy of the policy in memory.

`preference.reference: cached` (the default). The reference is the model as it starts
training, so right after the engine is built, before any checkpoint is loaded into it, that
model scores every pair of the train and eval splits once: eval mode, no grad, and under LoRA
with the adapters disabled (PEFT's `disable_adapter`), i.e. the base. Each part's log-probs,
float32 [pairs, 2] (chosen, rejected), are cached beside the tokenised data:

    data.cache_dir/reference-<key>/logps.npy + meta.json

key = the part's packed-data key (source content, tokenizer, format fields, seq_len, over-long
policy, carving) + the model's identity (its recipe section; a local directory's weight-file
signature, a hub checkpoint's commit, or for `init: random` the seed and transformers version)
+ what changes its numbers (precision, attention kernel, Liger kernels, the LoRA section). The
pass is dealt over data-parallel ranks like the stream, each rank running the same number of
forwards (under ZeRO-3 a forward gathers weights from every rank); every rank then holds all
log-probs (a few bytes per pair) and batches carry them (data/model_inputs.py). Training holds one
model. A resumed run reads the entry again; if the cache lost it, the pass runs again, still on
the freshly built model and so never against trained weights, and the data stream compares the
log-probs' digest with the one its checkpoint recorded (data/dealer.py), refusing any difference.

`preference.reference: live` scores the reference every step instead: under LoRA the policy's own
engine with the adapters disabled (no second copy); otherwise a frozen copy of the model, built
like the policy (inside zero.Init under ZeRO-3, so it is partitioned over the same ranks) and
wrapped in a DeepSpeed inference engine: TRL's `prepare_deepspeed`, which keeps ZeRO-3 sharding
and gives stages 0-2 a whole copy per rank (stage 0). The planner counts that copy.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llm_train.config.resolution import Resolved
from llm_train.data.cache import cached
from llm_train.data.fingerprint import CODE_VERSION, digest, files_signature
from llm_train.data.model_inputs import build_pair_rows
from llm_train.data.prepare import PackedSplit
from llm_train.errors import UserError
from llm_train.runtime.base import collectives
from llm_train.runtime.base.collectives import WORLD
from llm_train.runtime.engines.engine import to_device
from llm_train.runtime.loss.preference_tuning import Forward, iter_pairs
from llm_train.runtime.model.model import build_model, loss_tokens

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def model_identity(run: Resolved, config: PretrainedConfig) -> dict[str, Any]:
    """What the reference model's log-probs depend on, besides the data (see the module docstring)."""
    import transformers

    recipe = run.recipe
    identity: dict[str, Any] = {
        "model": recipe.model.model_dump(mode="json"),
        "precision": run.layout.precision,
        "attention": recipe.memory.attention,
        "liger": recipe.memory.liger_kernels,
        "lora": recipe.lora.model_dump(mode="json") if recipe.lora else None,
    }
    if recipe.model.init == "random":
        identity.update(seed=recipe.optim.seed, transformers=transformers.__version__)
        return identity
    local = Path(recipe.model.name_or_path or "").expanduser()
    if local.is_dir():
        files = [
            p for p in sorted(local.rglob("*")) if p.suffix in _WEIGHT_SUFFIXES or p.name == "config.json"
        ]
        identity["files"] = files_signature(files)
    else:  # a hub id: transformers records the commit the weights came from
        identity["commit"] = getattr(config, "_commit_hash", None)
    return identity


def reference_key(part_key: str, identity: dict[str, Any]) -> str:
    return digest("reference", CODE_VERSION, part_key, identity)


def _sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


def _read(entry: Path, pairs: int) -> np.ndarray | None:
    """The cached log-probs, or None when the entry is missing or does not verify."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
        logps = np.load(entry / "logps.npy")
    except (OSError, ValueError):
        return None
    if logps.shape != (pairs, 2) or meta.get("sha256") != _sha256(logps) or not np.isfinite(logps).all():
        return None
    return logps


class CachedReference:
    """The `prepare` of a DPO objective with a cached reference (runtime/loss/preference_tuning.py Preference)."""

    def __init__(
        self,
        run: Resolved,
        forward: Forward,
        config: PretrainedConfig,
        micro_batch: int,
        device: torch.device,
    ) -> None:
        self.run, self.forward, self.micro, self.device = run, forward, micro_batch, device
        self.identity = model_identity(run, config)
        self.cache_dir = Path(run.recipe.data.cache_dir).expanduser()

    def __call__(
        self, splits: list[PackedSplit | None], dp_rank: int, dp_size: int, say: Callable[[str], None]
    ) -> None:
        parts = [(split, i) for split in splits if split is not None for i in range(len(split.parts))]
        entries = [
            self.cache_dir / f"reference-{reference_key(s.parts[i].key, self.identity)}" for s, i in parts
        ]
        # Rank 0's cache decides and is sent to every rank (other nodes may not share its disk).
        found = WORLD.from_rank0(self._read_all(entries, parts, say) if collectives.rank() == 0 else None)
        started, computed = time.perf_counter(), 0
        for (split, i), entry, logps in zip(parts, entries, found, strict=True):
            part = split.parts[i]
            if logps is None:
                logps = self._score(split, i, dp_rank, dp_size)
                cached(entry, partial(_write, logps=logps, label=part.label, identity=self.identity))
                computed += part.n_sequences
            part.reference = logps
        total = sum(s.parts[i].n_sequences for s, i in parts)
        where = f"{self.cache_dir}/reference-*"
        if computed:
            say(
                f"reference: log-probs of {computed:,} pairs scored by the initial model in "
                f"{time.perf_counter() - started:.1f}s (one forward pass), cached in {where}"
            )
        if total > computed:
            say(f"reference: log-probs of {total - computed:,} pairs read from {where}")

    @staticmethod
    def _read_all(
        entries: list[Path], parts: list[tuple[PackedSplit, int]], say: Callable[[str], None]
    ) -> list[np.ndarray | None]:
        out = []
        for entry, (split, i) in zip(entries, parts, strict=True):
            logps = _read(entry, split.parts[i].n_sequences)
            if logps is None and (entry / "meta.json").is_file():
                # Damaged or hand-edited: scored again below (same key: the same model and data).
                say(f"notice: reference cache {entry} does not verify; scoring its pairs again")
                shutil.rmtree(entry, ignore_errors=True)
            out.append(logps)
        return out

    def _score(self, split: PackedSplit, part: int, dp_rank: int, dp_size: int) -> np.ndarray:
        """[pairs, 2] reference log-probs of one part; every rank takes part and gets all of them."""
        n = split.parts[part].n_sequences
        mine: list[tuple[list[int], np.ndarray]] = []
        for units in iter_pairs(n, self.micro, dp_rank, dp_size):
            batch = to_device(
                {
                    k: torch.as_tensor(v)
                    for k, v in build_pair_rows(split, [(part, u) for u in units]).items()
                },
                self.device,
            )
            labels = batch.pop("labels")
            batch.pop("reference_logps", None)
            sums = self.forward(batch, labels)
            mine.append((units, sums.detach().float().cpu().view(2, -1).T.numpy()))
        out = np.full((n, 2), np.nan, dtype=np.float32)
        for rank_results in WORLD.gather_objects(mine):
            for units, values in rank_results:
                out[units] = values
        if not np.isfinite(out).all():
            raise UserError(
                f"reference: the model's log-probs of {split.parts[part].label} are not finite; check the model "
                "(model.name_or_path) and precision"
            )
        return out


def _write(out: Path, logps: np.ndarray, label: str, identity: dict[str, Any]) -> dict[str, Any]:
    np.save(out / "logps.npy", logps)
    return {"pairs": len(logps), "sha256": _sha256(logps), "source": label, "model": identity}


def inference_ds_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    """The DS config of a frozen model that only runs forwards (TRL's prepare_deepspeed): no optimizer,
    scheduler or optimizer offload; ZeRO-3 stays (partitioned like the policy), stages 0-2 become 0."""
    config = copy.deepcopy(ds_config)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    zero = config.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)
    if int(zero.get("stage", 0)) != 3:
        zero["stage"] = 0
        zero.pop("offload_param", None)
    return config


def frozen_reference(run: Resolved, device: str | None) -> torch.nn.Module:
    """A frozen copy of the initial model in a DeepSpeed inference engine (call while zero.Init's
    config is registered, as for the policy, so that under ZeRO-3 it is built partitioned; `device`:
    where pretrained weights load, as for the policy, see model.build_model)."""
    import deepspeed

    recipe = run.recipe
    # Nothing is backpropagated through it: no activation checkpointing (nor its offload), no LoRA.
    memory = recipe.memory.model_copy(
        update={"activation_checkpointing": False, "offload_checkpoints": False}
    )
    model = build_model(
        recipe.model,
        memory,
        run.layout.precision,
        recipe.optim.seed,
        device=device,
        loss_tokens=loss_tokens(run),
    )
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=inference_ds_config(run.ds_config))
    engine.eval()
    return engine
