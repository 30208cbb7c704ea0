"""bitsandbytes' 8-bit AdamW under real 2-process DeepSpeed ZeRO-2 on CPU: it trains, its checkpoint holds
8-bit moments, and a resume from that checkpoint continues the curve bit for bit (DeepSpeed's ZeRO-2 file holds
bitsandbytes' own state_dict: codes, block maxima and maps).

The reference run of tests/e2e/reference.py (tiny-cpu fine-tuned from one saved tiny model, ZeRO-2,
checkpoints at step 3) with optim.name=adamw_8bit; a second launch resumes its step-3 checkpoint.
DeepSpeed steps the 8-bit optimizer over its flat fp32 partitions (one 1-D tensor per rank, far above
bitsandbytes' 4096-element threshold), so every moment is 8-bit. The loss curve against 32-bit
AdamW is measured in tests/unit/test_optim_8bit.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e.reference import RESUME_FROM, STEPS, run_args
from tests.helpers import assert_ok, assert_resumed, launch, losses
from tests.optional import needs

pytestmark = [pytest.mark.e2e, needs("bitsandbytes")]

EIGHT_BIT = ["optim.name=adamw_8bit"]


def test_adamw_8bit_trains_checkpoints_8bit_moments_and_resumes_exactly(
    pretrained: Path, tmp_path: Path
) -> None:
    from llm_train.runtime.checkpointing.commit import step_name

    first = tmp_path / "first"
    assert_ok(launch(run_args("zero2", first, pretrained) + EIGHT_BIT))
    curve = losses(first)
    assert sorted(curve) == list(range(1, STEPS + 1)) and curve[STEPS] < curve[1] - 0.3, curve
    ds = json.loads((first / "config" / "ds_config.json").read_text())
    assert ds["zero_allow_untested_optimizer"] is True

    checkpoint = first / "checkpoints" / step_name(RESUME_FROM)
    states = sorted(checkpoint.rglob("*optim_states.pt"))
    assert states, list(checkpoint.rglob("*"))
    saved = torch.load(states[0], map_location="cpu", weights_only=False)
    # Per param group, one flat partition: bitsandbytes nests its quantised state under its own key.
    groups = saved["optimizer_state_dict"]["base_optimizer_state"]["state"].values()
    quantised = [g["__bnb_optimizer_quant_state__"] for g in groups]
    decayed = quantised[0]  # the matrices (runtime/model/optim.py puts them in the first group): 8-bit codes
    assert decayed["state1"].dtype == decayed["state2"].dtype == torch.uint8
    assert decayed["absmax1"].numel() == -(-decayed["state1"].numel() // 256)

    resumed = tmp_path / "resumed"
    result = launch(run_args("zero2", resumed, pretrained) + EIGHT_BIT + ["--resume", str(checkpoint)])
    assert_ok(result)
    assert_resumed(result.stdout, checkpoint, RESUME_FROM)
    again = losses(resumed)
    assert {s: again[s] for s in range(RESUME_FROM + 1, STEPS + 1)} == {
        s: curve[s] for s in range(RESUME_FROM + 1, STEPS + 1)
    }
