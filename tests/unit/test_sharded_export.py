"""LoRA's final/ written layer by layer (runtime/export/sharded.py): the merge, the files, the host peak."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from llm_train.config.recipe import load_recipe
from llm_train.config.recipe_sections import LoraSection
from llm_train.runtime.export.sharded import merged_tensors, no_gather, write_merged
from llm_train.runtime.model.lora import apply_lora
from tests.helpers import REPO
from tests.optional import import_or_skip
from tests.unit.test_lora import TINY, tiny_model

import_or_skip("peft")


def _with_trained_adapters(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():  # B starts at zero; give the adapters something to merge
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return model


def test_merged_tensors_equal_peft_merge() -> None:
    model = _with_trained_adapters(apply_lora(tiny_model(), LoraSection(rank=4, alpha=8, dropout=0.0)))
    merged = {k: v.clone() for k, v in merged_tensors(model, no_gather, torch.float32)}
    reference = model.merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    for key, value in reference.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-6)
    assert not any("lora" in k or "base_layer" in k for k in merged)


def test_write_merged_is_a_sharded_hf_directory_with_the_merged_logits(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(load_recipe("tiny-cpu").model.tokenizer)
    model = _with_trained_adapters(apply_lora(tiny_model(), LoraSection(rank=4, alpha=8, dropout=0.0)))
    ids = torch.tensor([[5, 17, 99, 1000, 7]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    # Small shards, so the tiny model spans several files and needs the index.
    peak = write_merged(
        model, tmp_path, tokenizer, no_gather, torch.float32, write=True, max_shard_bytes=256 * 1024
    )
    files = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and set(index["weight_map"].values()) == {f.name for f in files}
    assert peak <= 256 * 1024 + 4096 * 128 * 4  # a shard, or one tensor larger than a shard (the embedding)
    assert not list(tmp_path.glob(".part-*"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=0, atol=1e-5)


def test_tied_embeddings_are_written_once(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(TINY, tie_word_embeddings=True)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = apply_lora(AutoModelForCausalLM.from_config(config), LoraSection(rank=4))
    names = [name for name, _ in merged_tensors(model, no_gather, torch.float32)]
    assert names.count("model.embed_tokens.weight") == 1 and "lm_head.weight" not in names


# Run in a fresh interpreter: glibc's malloc keeps freed memory for reuse, which would let an export
# that copies the model reuse what an earlier test freed and show no growth. A fixed mmap threshold
# returns every large block to the OS when torch frees it, so RSS follows what is alive.
_MEASURE = textwrap.dedent(
    """
    import json, sys, threading, time
    import psutil, torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from llm_train.config.recipe import LoraSection, load_recipe
    from llm_train.runtime.model.lora import apply_lora
    from llm_train.runtime.export.sharded import no_gather, write_merged

    config = AutoConfig.for_model(
        "llama", vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False,
    )
    model = apply_lora(AutoModelForCausalLM.from_config(config), LoraSection(rank=8, dropout=0.0))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tokenizer = AutoTokenizer.from_pretrained(load_recipe("tiny-cpu").model.tokenizer)
    me = psutil.Process()

    def growth(work):
        start, peak, done = me.memory_info().rss, [0], threading.Event()
        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], me.memory_info().rss - start)
                time.sleep(0.002)
        thread = threading.Thread(target=sample)
        thread.start()
        result = work()
        done.set()
        thread.join()
        return peak[0], result

    export, _ = growth(lambda: write_merged(
        model, sys.argv[1], tokenizer, no_gather, torch.float32, write=True, max_shard_bytes=32 * 2**20
    ))
    # The control: what the meter reads for one full copy of the weights (the old export made two).
    copy, kept = growth(lambda: {k: v.clone() for k, v in model.state_dict().items()})
    print(json.dumps({"model": model_bytes, "export": export, "copy": copy}))
    """
)


def test_merged_export_never_holds_a_second_copy_of_the_model(tmp_path: Path) -> None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path / "out")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    model, export, copy = measured["model"], measured["export"], measured["copy"]
    print(
        f"model {model / 2**20:.0f} MiB: export grew RSS by {export / 2**20:.0f} MiB, one copy by {copy / 2**20:.0f} MiB"
    )
    assert copy >= 0.9 * model, measured  # the meter sees a copy of the model when there is one
    # One 32 MiB shard, one merged projection in flight (fp32 weight + delta), page cache of the files
    # being written counted in RSS by some kernels: far below a second copy.
    assert export <= 0.35 * model, measured
