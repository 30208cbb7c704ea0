"""`llm-train generate | chat`: the model's own greedy text through the recipe's tokenizer and template.

On a tiny Llama saved with save_pretrained (tests/helpers.py), so nothing trains here: greedy output
is deterministic, and the command must give exactly what transformers' own `generate` gives on the
same model and token ids. Run directories and checkpoints: tests/e2e/test_eval.py.
"""

from __future__ import annotations

import io
import json
import math
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
import yaml

from llm_train import cli
from llm_train.commands.model_source import load_model, resolve_source
from llm_train.config.recipe import load_recipe
from tests.helpers import make_tiny_pretrained
from tests.optional import require

PROMPT = "The import statement"
NEW = 12


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_pretrained(tmp_path_factory.mktemp("gen") / "tiny", seed=3)


def _greedy(model: torch.nn.Module, tokenizer: object, ids: list[int]) -> str:
    inputs = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(  # type: ignore[operator]
            input_ids=inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=NEW, do_sample=False
        )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)  # type: ignore[attr-defined]


def _hf(path: Path) -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(argv) == 0
    return capsys.readouterr().out


def test_greedy_generate_equals_transformers_generate(
    pretrained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _cli(["generate", str(pretrained), "--prompt", PROMPT, "--max-new-tokens", str(NEW)], capsys)
    model, tokenizer = _hf(pretrained)
    want = _greedy(model, tokenizer, tokenizer(PROMPT)["input_ids"])  # type: ignore[operator]
    assert want.strip() and out == want + "\n"


def test_a_prompt_file_gives_one_answer_per_prompt(
    pretrained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The import statement\n\nA list is\n")
    out = _cli(
        ["generate", str(pretrained), "--prompt-file", str(prompts), "--max-new-tokens", str(NEW)], capsys
    )
    model, tokenizer = _hf(pretrained)
    want = "".join(
        f"### {p}\n{_greedy(model, tokenizer, tokenizer(p)['input_ids'])}\n"  # type: ignore[operator]
        for p in ("The import statement", "A list is")
    )
    assert out == want


def test_chat_reads_stdin_keeps_the_conversation_and_stops_at_eof(
    pretrained: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is a list?\n\nAnd a tuple?\n"))  # then EOF
    out = _cli(["chat", str(pretrained), "--max-new-tokens", str(NEW), "--system", "Be brief."], capsys)
    model, tokenizer = _hf(pretrained)
    messages = [{"role": "system", "content": "Be brief."}]
    want = []
    for question in ("What is a list?", "And a tuple?"):  # the blank line is no message
        messages.append({"role": "user", "content": question})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # type: ignore[attr-defined]
        answer = _greedy(model, tokenizer, tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
        messages.append({"role": "assistant", "content": answer})
        want.append(answer)
    assert out == "".join(f"{a}\n" for a in want)


def test_a_lora_adapter_export_runs_through_peft(
    pretrained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from peft import LoraConfig, get_peft_model

    model, tokenizer = _hf(pretrained)
    torch.manual_seed(0)
    peft_model = get_peft_model(
        model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)  # type: ignore[attr-defined]
    assert cli.main(["generate", str(adapter), "--prompt", PROMPT, "--max-new-tokens", str(NEW)]) == 0
    out, err = capsys.readouterr()
    assert f"PEFT adapter on {pretrained}" in err
    peft_model.eval()
    want = _greedy(peft_model, tokenizer, tokenizer(PROMPT)["input_ids"])  # type: ignore[operator]
    assert out == want + "\n"
    # The adapter changes the answer: the base alone gives another text (else the test shows nothing).
    assert want != _greedy(_hf(pretrained)[0], tokenizer, tokenizer(PROMPT)["input_ids"])  # type: ignore[operator]


def test_a_qlora_runs_base_loads_in_4_bits_when_bitsandbytes_is_there(
    pretrained: Path, tmp_path: Path
) -> None:
    require("bitsandbytes")
    from peft import LoraConfig, get_peft_model

    model, tokenizer = _hf(pretrained)
    run = tmp_path / "run"
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(run / "final")
    tokenizer.save_pretrained(run / "final")  # type: ignore[attr-defined]
    overrides = [
        "lora.quantize=nf4",
        "lora.export=adapter",
        "model.init=pretrained",
        f"model.name_or_path={pretrained}",
    ]
    recipe = load_recipe("tiny-cpu-lora", overrides)
    (run / "config").mkdir()
    (run / "config" / "recipe.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
    source = resolve_source(run)
    assert source.model_dir == run / "final" and source.adapter
    loaded, how = load_model(source, torch.float32)
    assert "base in nf4" in how
    import bitsandbytes as bnb

    assert any(isinstance(m, bnb.nn.Linear4bit) for m in loaded.modules())
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])  # type: ignore[operator]
    with torch.no_grad():
        assert torch.isfinite(loaded(input_ids=ids).logits).all()


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line `llm-train ARGV` ends with, exit 2 (cli.main lets anything but a UserError through)."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_model_directory_without_tokenizer_files_is_one_line_naming_the_fix(
    pretrained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # What a hand-made export looks like: config and weights, no tokenizer.
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((pretrained / name).read_bytes())
    line = _refused(["generate", str(tmp_path), "--prompt", PROMPT], capsys)
    assert line.startswith(f"llm-train: error: {tmp_path}: no tokenizer files (tokenizer.json, ")
    assert "copy the tokenizer files of the model it was trained from into it" in line

    # Files that are there but do not make a tokenizer: transformers' reason, and the same fix.
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    line = _refused(["generate", str(tmp_path), "--prompt", PROMPT], capsys)
    assert "its tokenizer does not load (" in line and "copy the tokenizer files" in line


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_model_larger_than_the_free_host_ram_is_refused_before_it_loads(
    command: str, pretrained: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import psutil
    from transformers import AutoModelForCausalLM

    # Its weights: 2 x 8 x 256 embeddings plus two blocks; in fp32 (what --dtype auto is on a CPU) they
    # take 4 bytes each. A host with less free than that is refused before transformers is asked.
    need = sum(p.numel() for p in _hf(pretrained)[0].state_dict().values()) * 4
    capsys.readouterr()  # that load's progress bar
    free = need // 3
    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=free))

    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    argv = [command, str(pretrained)] + (["--prompt", PROMPT] if command == "generate" else [])
    line = _refused(argv, capsys)
    assert f"{pretrained}: its weights take {need / 2**30:.1f} GiB of host RAM in float32 to load" in line
    assert f"this machine has {free / 2**30:.1f} GiB free" in line
    assert (
        "--dtype bf16" in line
        and "--quantize nf4" in line
        and "or a machine with at least 1 GiB free" in line
    )


def test_a_model_larger_than_the_physical_ram_is_the_same_one_line(
    pretrained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import psutil

    # A weights file twice this host's physical memory, sparse (a header and a hole: no disk used). Mapping
    # it whole fails ("unable to mmap"), so the size must come from its header, as for a smaller model.
    model = tmp_path / "huge"
    shutil.copytree(pretrained, model)
    weights = 2 * psutil.virtual_memory().total // 4  # fp32 elements
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [weights], "data_offsets": [0, weights * 4]}}
    ).encode()
    with (model / "model.safetensors").open("wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.truncate(8 + len(header) + weights * 4)
    line = _refused(["generate", str(model), "--prompt", PROMPT], capsys)
    assert f"{model}: its weights take {weights * 4 / 2**30:.1f} GiB of host RAM in float32 to load" in line
    assert (
        "--quantize nf4" in line
        and f"a machine with at least {math.ceil(weights * 4 / 2**30)} GiB free" in line
    )


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-cpu-vlm's model, random, saved with its processor as an export is."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from llm_train.assets import vlm

    recipe = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu-vlm.yaml").read_text()
    )
    fields = dict(recipe["model"]["config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("vlm") / "export"
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    AutoProcessor.from_pretrained(vlm.DEFAULT_OUT / "processor").save_pretrained(out)
    return out


def test_generate_with_an_image_equals_transformers_generate_with_the_processor(
    tiny_vlm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from llm_train.assets import vlm

    image = vlm.DEFAULT_OUT / "images" / "red-circle.png"
    argv = ["generate", str(tiny_vlm), "--image", str(image), "--prompt", "Caption this image."]
    out = _cli([*argv, "--max-new-tokens", str(NEW)], capsys)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm).eval()
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    from PIL import Image

    message = {
        "role": "user",
        "content": [
            {"type": "image", "image": Image.open(image).convert("RGB")},
            {"type": "text", "text": "Caption this image."},
        ],
    }
    inputs = processor.apply_chat_template(
        [message], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert int((inputs["input_ids"] == processor.image_token_id).sum()) == 16  # the image reached the ids
    with torch.no_grad():
        ids = model.generate(
            **inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id
        )
    want = processor.tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert out == want + "\n"
    # The pixels matter: another image gives other logits for the first new token.
    other = vlm.DEFAULT_OUT / "images" / "blue-square.png"
    logits = []
    for path in (image, other):
        message["content"][0]["image"] = Image.open(path).convert("RGB")
        inputs = processor.apply_chat_template(
            [message], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        with torch.no_grad():
            logits.append(model(**inputs).logits[0, -1])
    assert not torch.allclose(logits[0], logits[1])


def test_images_for_a_text_only_model_or_a_missing_image_are_one_line(
    pretrained: Path, tiny_vlm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llm_train.assets import vlm

    image = str(vlm.DEFAULT_OUT / "images" / "red-circle.png")
    assert cli.main(["generate", str(pretrained), "--image", image, "--prompt", "hi"]) == 2
    assert "--image: " in capsys.readouterr().err
    assert cli.main(["generate", str(tiny_vlm), "--image", str(tmp_path / "none.png"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "image file not found" in err and len(err.strip().splitlines()) == 1


def test_chat_with_an_image_answers_each_turn_through_the_processor(
    tiny_vlm: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`chat --image`: the image goes with the first message; a `/image PATH` line adds one to the next."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from llm_train.assets import vlm

    first, second = (str(vlm.DEFAULT_OUT / "images" / f"{n}.png") for n in ("red-circle", "blue-square"))
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"What is it?\n/image {second}\nAnd this?\n"))
    out = _cli(["chat", str(tiny_vlm), "--image", first, "--max-new-tokens", str(NEW)], capsys)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm).eval()
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    from PIL import Image

    messages: list[dict[str, object]] = []
    want = []
    for path, text in ((first, "What is it?"), (second, "And this?")):
        image = Image.open(path).convert("RGB")
        messages.append(
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}
        )
        inputs = processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        with torch.no_grad():
            ids = model.generate(
                **inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id
            )
        answer = processor.tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        want.append(answer)
    assert int((inputs["input_ids"] == processor.image_token_id).sum()) == 32  # both images in the last turn
    assert out == "".join(f"{a}\n" for a in want)
