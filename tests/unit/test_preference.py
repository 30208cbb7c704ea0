"""Preference tuning's rules before anything runs: the recipe, the layouts it refuses, the planner.

The data format is tests/unit/test_data_preference.py; the losses against TRL
tests/unit/test_objectives.py; real runs tests/e2e/test_preference.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llm_train.config.recipe import load_recipe, recipe_to_yaml
from llm_train.config.resolution import resolve_run
from llm_train.errors import UserError
from llm_train.planning.memory.estimate import estimate_memory
from llm_train.planning.memory.inputs import MemoryInputs
from llm_train.planning.model.shapes import shape_of
from llm_train.planning.report.verdict import plan_recipe, render
from llm_train.planning.speed.step_time import step_time
from tests.devices import CPU

EIGHT_B = shape_of("meta-llama/Llama-3.1-8B")


def _refused(recipe: str, overrides: list[str], match: str) -> str:
    with pytest.raises(UserError, match=match) as info:
        load_recipe(recipe, overrides)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_pairs_and_preference_objectives_come_together() -> None:
    _refused(
        "tiny-cpu",
        ["objective=dpo"],
        r"data.train\[0\] is format text, but objective=dpo trains on pairs; give every data.train and data.eval "
        r"source format: preference",
    )
    _refused(
        "tiny-cpu-dpo",
        ["objective=lm"],
        r"data.train\[0\] is format preference, which trains with a preference objective; set objective: dpo",
    )
    _refused("tiny-cpu", ["preference.beta=0.2"], r"preference.beta is set but objective is lm")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["data.packing=packed"],
            r"objective=dpo trains each pair as two padded rows.*set data.packing=padded",
        ),
        (
            ["objective=simpo", "preference.reference=live"],
            r"simpo is reference-free: remove preference.reference",
        ),
        (["preference.simpo_gamma=1.0"], r"preference.simpo_gamma applies to objective simpo"),
        (
            ["data.eval_fraction=0", "data.train=[{path: p.jsonl, format: preference, streaming: true}]"],
            r"data.train\[0\].streaming=true: preference pairs are tokenised up front.*remove streaming",
        ),
        (["data.train=[{path: p.jsonl, format: preference, overlong: split}]"], r"overlong"),
        (["preference.label_smoothing=0.5"], r"label_smoothing"),
    ],
    ids=["packed", "simpo-live", "gamma-for-dpo", "streaming", "split", "smoothing-0.5"],
)
def test_what_pairs_cannot_use_is_refused_in_one_line(overrides: list[str], match: str) -> None:
    _refused("tiny-cpu-dpo", overrides, match)


def test_beta_defaults_to_the_objectives_own_and_is_written_into_the_recipe(tmp_path: Path) -> None:
    assert load_recipe("tiny-cpu-dpo", ["preference.beta=null"]).preference.beta == 0.1
    simpo = load_recipe("tiny-cpu-dpo", ["preference.beta=null", "objective=simpo"])
    assert simpo.preference.beta == 2.0 and simpo.sequences_per_sample == 2
    assert "beta: 2.0" in recipe_to_yaml(simpo)
    # A dumped recipe lists every preference field; loading it again must not read them as set.
    for recipe in (load_recipe("tiny-cpu"), simpo):
        path = tmp_path / f"{recipe.name}-{recipe.objective}.yaml"
        path.write_text(recipe_to_yaml(recipe))
        assert load_recipe(str(path)).model_dump() == recipe.model_dump()


@pytest.mark.parametrize(
    ("overrides", "world", "setting"),
    [
        (["deepspeed.config=zero1", "deepspeed.pipeline_stages=2"], 2, "deepspeed.pipeline_stages=2"),
        (["deepspeed.config=zero1_tp"], 2, "tensor_parallel.autotp_size=2"),
        (["deepspeed.sequence_parallel=2"], 2, "deepspeed.sequence_parallel=2"),
    ],
    ids=["pipeline", "autotp", "ulysses"],
)
def test_layouts_that_split_a_sequence_or_its_logits_are_refused(
    overrides: list[str], world: int, setting: str
) -> None:
    with pytest.raises(UserError) as info:
        resolve_run("tiny-cpu-dpo", overrides, world_size=world, device=CPU)
    message = str(info.value)
    assert "\n" not in message and f"objective=dpo is not supported with {setting}" in message
    assert "train preferences with ZeRO data parallelism (ZeRO-0..3, offload, LoRA)" in message


@pytest.mark.parametrize("ds_config", ["zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"])
def test_every_zero_layout_resolves(ds_config: str) -> None:
    run = resolve_run("tiny-cpu-dpo", [f"deepspeed.config={ds_config}"], world_size=2, device=CPU)
    assert run.recipe.objective == "dpo" and run.layout.dp == 2


def _inputs(**changes: object) -> MemoryInputs:
    base = {
        "zero_stage": 3,
        "micro_batch": 2,
        "seq_len": 1024,
        "activation_checkpointing": False,
        "dense_mask": True,
    }
    return MemoryInputs.of(EIGHT_B, world_size=8, **{**base, **changes})  # type: ignore[arg-type]


def test_a_pair_is_two_sequences_in_memory_and_time() -> None:
    pairs = _inputs(sequences_per_sample=2, reference="cached")
    rows = _inputs(micro_batch=4)  # the same rows as plain sequences
    ours, theirs = estimate_memory(pairs), estimate_memory(rows)
    for term in ("activations", "logits_and_loss", "attention_mask"):
        assert ours.gpu_terms[term] == theirs.gpu_terms[term] > estimate_memory(_inputs()).gpu_terms[term]
    assert "reference_model" not in ours.gpu_terms  # cached: no second model
    assert step_time(pairs, 8, 989.0).compute == pytest.approx(step_time(rows, 8, 989.0).compute)


def test_the_live_reference_copy_is_counted_sharded_under_zero3_and_whole_below() -> None:
    weights = EIGHT_B.num_params * 2  # 16-bit
    zero3 = estimate_memory(_inputs(sequences_per_sample=2, reference="live"))
    persistent = EIGHT_B.small_tensor_params(10 * EIGHT_B.hidden_size) * 2
    expected = persistent + (weights - persistent) / 8
    assert zero3.gpu_terms["reference_model"] == pytest.approx(expected, rel=1e-6)
    zero2 = estimate_memory(_inputs(zero_stage=2, sequences_per_sample=2, reference="live"))
    assert zero2.gpu_terms["reference_model"] == weights  # TRL's stage-0 copy on every GPU
    offloaded = estimate_memory(
        _inputs(offload_optimizer="cpu", offload_params="cpu", sequences_per_sample=2, reference="live")
    )
    assert offloaded.gpu_terms["reference_model"] == pytest.approx(persistent)
    assert offloaded.host_terms["offloaded_reference_parameters"] > 0
    # Under LoRA the live reference is the base with the adapters disabled: nothing more to hold.
    lora = estimate_memory(_inputs(lora_rank=16, sequences_per_sample=2, reference="live"))
    assert "reference_model" not in lora.gpu_terms


def test_the_live_reference_costs_a_forward_per_micro_batch() -> None:
    cached = step_time(_inputs(sequences_per_sample=2, reference="cached"), 8, 989.0)
    live = step_time(_inputs(sequences_per_sample=2, reference="live"), 8, 989.0)
    # Training is ~3 forwards (forward + backward), the reference one more: ~+1/3 of the compute.
    assert 1.25 < live.compute / cached.compute < 1.4
    assert live.communication > cached.communication  # its ZeRO-3 shards are gathered too


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ([], "reference log-probs cached: one forward pass over the pairs before step 1"),
        (["preference.reference=live"], "live reference: a frozen copy of the model"),
        (
            ["preference.reference=live", "lora.rank=8"],
            "the base with the LoRA adapters disabled (no second copy)",
        ),
        (
            ["objective=simpo", "preference.beta=null"],
            "reference-free: no reference model and no reference pass",
        ),
    ],
    ids=["cached", "live-copy", "live-lora", "simpo"],
)
def test_plan_shows_the_pairs_and_the_reference(overrides: list[str], says: str) -> None:
    report = plan_recipe("tiny-cpu-dpo", overrides, host_ram_gib=16, detect=False)
    text = render(report)
    assert "micro 4 pairs (8 rows)" in text
    assert (
        "each pair trains two sequences (chosen, rejected): micro 4 pairs = 8 rows" in text and says in text
    )
    if overrides == ["preference.reference=live"]:
        assert "DPO reference model (frozen copy, 16-bit)" in text


def test_the_cached_reference_scores_once_reads_after_and_rescores_what_does_not_verify(
    tmp_path: Path,
) -> None:
    """runtime/reference.CachedReference in a world of one: the pass, the cache entry, the key."""
    import numpy as np
    import torch

    from llm_train.data import prepare_data
    from llm_train.data.model_inputs import build_pair_rows
    from llm_train.runtime.engines.reference import CachedReference
    from llm_train.runtime.loss.preference_tuning import reference_forward, sequence_logps
    from llm_train.runtime.model.model import build_model, load_tokenizer
    from tests.unit.data_fixtures import write_jsonl

    pairs = [
        {"prompt": f"Question {i}?", "chosen": f"answer {i} " * (1 + i % 3), "rejected": "no"}
        for i in range(5)
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    overrides = [f"data.cache_dir={tmp_path / 'cache'}", f"data.train=[{{path: {path}, format: preference}}]"]
    run = resolve_run("tiny-cpu-dpo", [*overrides, "data.eval_fraction=0"], world_size=1, device=CPU)
    recipe = run.recipe
    split = prepare_data(recipe.data, load_tokenizer(recipe.model), recipe.optim.seed).train
    model = build_model(recipe.model, recipe.memory, "fp32", recipe.optim.seed)
    calls: list[int] = []
    own = reference_forward(model)

    def counted(batch: dict, labels: torch.Tensor) -> torch.Tensor:
        calls.append(batch["input_ids"].shape[0])
        return own(batch, labels)

    scorer = CachedReference(run, counted, model.config, micro_batch=2, device=torch.device("cpu"))
    said: list[str] = []
    scorer([split, None], 0, 1, said.append)
    assert calls == [4, 4, 4] and "reference: log-probs of 5 pairs scored by the initial model" in said[0]
    logps = split.parts[0].reference
    assert logps is not None and logps.shape == (5, 2) and logps.dtype == np.float32
    # Each pair's two rows, scored on their own, give the same numbers (batch composition aside).
    for k in range(5):
        batch = {
            n: torch.as_tensor(v)
            for n, v in build_pair_rows(split, [(0, k)]).items()
            if n != "reference_logps"
        }
        labels = batch.pop("labels")
        with torch.no_grad():
            alone, _ = sequence_logps(model(**batch).logits, labels)
        assert np.allclose(logps[k], alone.numpy(), atol=1e-5)

    split.parts[0].reference = None
    calls.clear()
    scorer([split], 0, 1, said.append)
    assert calls == [] and "read from" in said[-1] and np.array_equal(split.parts[0].reference, logps)

    (entry,) = [p for p in (tmp_path / "cache").glob("reference-*") if p.is_dir()]
    np.save(entry / "logps.npy", logps + 1)  # no longer what meta.json's sha256 says
    scorer([split], 0, 1, said.append)
    assert calls == [4, 4, 4] and "does not verify; scoring its pairs again" in said[-2]
    assert np.array_equal(split.parts[0].reference, logps)

    # Another model (another seed: other initial weights) is another entry, never this one.
    other = resolve_run(
        "tiny-cpu-dpo", [*overrides, "data.eval_fraction=0", "optim.seed=7"], world_size=1, device=CPU
    )
    assert CachedReference(other, counted, model.config, 2, torch.device("cpu")).identity != scorer.identity


@pytest.mark.parametrize(
    ("recipe", "overrides", "match"),
    [
        (
            "tiny-cpu",
            ["objective=reward"],
            r"data.train\[0\] is format text, but objective=reward trains on pairs",
        ),
        (
            "tiny-cpu-dpo",
            ["reward.margin=0.5"],
            r"reward.margin is set but objective is dpo; set objective: reward",
        ),
        ("tiny-cpu-reward", ["preference.beta=0.2"], r"preference.beta applies to objective dpo or simpo"),
        ("tiny-cpu-reward", ["lora.rank=8"], r"lora: objective reward trains the whole model"),
        ("tiny-cpu-reward", ["memory.tiled_loss=true"], r"memory.tiled_loss applies to the token loss"),
        ("tiny-cpu-reward", ["data.packing=packed"], r"objective=reward trains each pair as two padded rows"),
        ("tiny-cpu-reward", ["reward.center_rewards_coefficient=0"], r"center_rewards_coefficient"),
    ],
    ids=["text-data", "reward-for-dpo", "beta", "lora", "tiled-loss", "packed", "centring-0"],
)
def test_a_reward_model_reads_pairs_and_refuses_what_it_cannot_use_in_one_line(
    recipe: str, overrides: list[str], match: str
) -> None:
    _refused(recipe, overrides, match)


def test_a_reward_recipe_trains_two_rows_per_pair_and_keeps_its_reward_settings() -> None:
    recipe = load_recipe("tiny-cpu-reward", ["reward.center_rewards_coefficient=0.01"])
    assert recipe.objective == "reward" and recipe.sequences_per_sample == 2
    assert recipe.reward.center_rewards_coefficient == 0.01 and recipe.preference.beta is None
