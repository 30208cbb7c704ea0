"""`llm-train generate | chat MODEL`: text from a run directory, a checkpoint or an exported model.

    llm-train generate runs/demo --prompt "The import statement"        greedy continuation
    llm-train generate runs/demo --prompt-file prompts.txt --temperature 0.7 --top-p 0.9
    llm-train chat runs/tiny-cpu-chat                                   a conversation on stdin (EOF ends it)
    llm-train generate runs/tiny-cpu-vlm --image red.png --prompt "What is in the picture?"

Images (`--image`, repeatable; in `chat` also a line `/image PATH` before a message) go to an image-text
model through its processor (AutoProcessor from the model folder, the one the run trained with): the
message becomes the image parts followed by the text, rendered by the processor's chat template, and the
pixel values go to `generate` with the ids. Image files are read as training reads them
(data/formats/images.py), so a missing or unreadable one is the same one-line refusal.

The model and its tokenizer come from commands/model_source.py (a run's final/, a checkpoint
exported first, an export; LoRA adapters through PEFT, a QLoRA base in 4 bits when bitsandbytes
imports); the chat template is the one the run trained with. Generation is transformers' own
`generate` with the sampling options given here (greedy unless --temperature > 0).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, cast

from llm_train.commands.model_source import (
    is_image_text_dir,
    load_model,
    load_tokenizer,
    resolve_source,
    torch_dtype,
)
from llm_train.data.formats.image_chat import load_processor
from llm_train.data.formats.images import read_image
from llm_train.errors import UserError
from llm_train.observability.library_logs import quiet

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Sampling:
    """transformers' generate options, as the command line gives them."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int = 0

    def kwargs(self, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
        options: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": self.temperature > 0,
            "pad_token_id": tokenizer.pad_token_id,
            "repetition_penalty": self.repetition_penalty,
        }
        if self.temperature > 0:
            options.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or None)
        return options


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """MODEL and how it loads: shared by generate, chat and eval."""
    parser.add_argument(
        "model",
        help="A run directory (its final/, else its newest checkpoint), a checkpoint (checkpoints/step-N, "
        "exported first into RUN_DIR/exports/) or an exported model (plain or PEFT adapter).",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp16", "fp32"],
        default="auto",
        help="auto: bf16 on GPUs, fp32 on CPU.",
    )
    parser.add_argument(
        "--quantize",
        choices=["auto", "none", "nf4", "int8"],
        default="auto",
        help="Load through bitsandbytes; auto: an adapter's base as the run had it (lora.quantize) when "
        "bitsandbytes imports.",
    )


def _add_sampling(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128, help="Tokens to generate (default 128).")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample.")
    parser.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling (with --temperature).")
    parser.add_argument("--top-k", type=int, default=0, help="Top-k sampling (with --temperature; 0: off).")
    parser.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="transformers' repetition_penalty."
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed for sampling.")
    parser.add_argument("--system", help="A system message before the conversation (chat template).")
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="An image for an image-text model, before the (first) message's text; repeat for several. The "
        "prompt then goes through the chat template as a user message.",
    )


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    generate = subparsers.add_parser("generate", help="Continue prompts with a trained or exported model.")
    add_model_args(generate)
    prompts = generate.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", help="The text to continue.")
    prompts.add_argument("--prompt-file", help="A file of prompts, one per line (blank lines skipped).")
    generate.add_argument(
        "--chat", action="store_true", help="Send each prompt as a user message through the chat template."
    )
    _add_sampling(generate)
    generate.set_defaults(func=cmd_generate)
    chat = subparsers.add_parser(
        "chat", help="Talk to a trained or exported model: one user message per line on stdin, until EOF."
    )
    add_model_args(chat)
    _add_sampling(chat)
    chat.set_defaults(func=cmd_chat)


def _sampling(args: argparse.Namespace) -> Sampling:
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UserError("--temperature must be >= 0 and --top-p in (0, 1]")
    return Sampling(
        args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.repetition_penalty, args.seed
    )


class Generator:
    """A loaded model and tokenizer, and the sampling options every answer uses."""

    def __init__(
        self, model: Any, tokenizer: PreTrainedTokenizerBase, sampling: Sampling, processor: Any = None
    ) -> None:
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling  # model: HF, or PEFT around it
        self.processor = processor  # an image-text model's, else None
        self.where = str(tokenizer.name_or_path)

    @classmethod
    def load(cls, args: argparse.Namespace) -> Generator:
        quiet(verbose=False)  # transformers' load progress bars and advisories stay out of the text
        source = resolve_source(Path(args.model), lambda m: print(m, file=sys.stderr))
        tokenizer = load_tokenizer(source)
        image_text = is_image_text_dir(source.model_dir)
        if args.image and not image_text and not source.adapter:
            raise UserError(
                f"--image: {source.model_dir} is a text-only model (its config.json names no image-text "
                "architecture); drop --image or give an image-text model"
            )
        processor = None
        # chat loads it for an image-text model even without --image: a later `/image PATH` line needs it.
        if args.image or (image_text and args.func is cmd_chat):
            processor = load_processor(tokenizer, "--image")
        model, how = load_model(source, torch_dtype(args.dtype), args.quantize)
        print(f"llm-train: {source.model_dir} ({how})", file=sys.stderr)
        return cls(model, tokenizer, _sampling(args), processor)

    def answer_with_images(self, messages: list[dict[str, Any]]) -> str:
        """The assistant's answer to messages whose content may hold image parts (PIL images), through the
        processor (its chat template, pixel values and image tokens) and `generate`."""
        import torch

        torch.manual_seed(self.sampling.seed)
        device = next(self.model.parameters()).device
        inputs = self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        ).to(device)
        with torch.no_grad():
            out = self.model.generate(**inputs, **self.sampling.kwargs(self.tokenizer))
        new = out[0, inputs["input_ids"].shape[1] :]
        return cast(str, self.tokenizer.decode(new, skip_special_tokens=True))

    @staticmethod
    def user_message(text: str, images: list[Any]) -> dict[str, Any]:
        """A user message: plain text, or (with images, PIL) the image parts followed by the text."""
        if not images:
            return {"role": "user", "content": text}
        parts: list[dict[str, Any]] = [{"type": "image", "image": image} for image in images]
        return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}

    def complete(self, ids: list[int]) -> str:
        """The text generated after the token ids `ids` (special tokens left out)."""
        import torch

        torch.manual_seed(self.sampling.seed)
        device = next(self.model.parameters()).device
        inputs = torch.tensor([ids], device=device)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=inputs,
                attention_mask=torch.ones_like(inputs),
                **self.sampling.kwargs(self.tokenizer),
            )
        # One sequence decodes to one str (the annotation also covers a batch's list).
        return cast(str, self.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))

    def prompt_ids(self, prompt: str) -> list[int]:
        """A raw prompt as the tokenizer encodes it by default (its bos, if it adds one)."""
        return list(self.tokenizer(prompt)["input_ids"])

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The conversation through the chat template, ending with the assistant's generation prompt."""
        if not self.tokenizer.chat_template:
            raise UserError(
                f"tokenizer '{self.tokenizer.name_or_path}' has no chat template; set data.chat_template in the "
                "run's recipe, or use `llm-train generate` without --chat"
            )
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(cast(str, rendered), add_special_tokens=False)["input_ids"])


def read_images(paths: list[str], flag: str = "--image") -> list[Any]:
    """The images, read before any model loads (a missing or unreadable file costs no load)."""
    return [read_image(path, f"{flag} {path}", Path.cwd()) for path in paths]


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    path = Path(args.prompt_file)
    if not path.is_file():
        raise UserError(f"--prompt-file {path}: no such file")
    prompts = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"--prompt-file {path}: holds no prompt (one per line)")
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = _prompts(args)
    images = read_images(args.image)
    generator = Generator.load(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    for prompt in prompts:
        if args.image:
            if len(prompts) > 1:
                print(f"### {prompt}")
            print(
                generator.answer_with_images([*system, generator.user_message(prompt, images)]),
                flush=True,
            )
            continue
        if args.chat:
            ids = generator.chat_ids([*system, {"role": "user", "content": prompt}])
        else:
            ids = generator.prompt_ids(prompt)
        if len(prompts) > 1:
            print(f"### {prompt}")
        print(generator.complete(ids), flush=True)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    images = read_images(args.image)
    generator = Generator.load(args)
    return chat_loop(generator, sys.stdin, sys.stdout, args.system, images)


def chat_loop(
    generator: Generator,
    lines: Iterable[str] | TextIO,
    out: TextIO,
    system: str | None,
    images: list[Any] | None = None,
) -> int:
    """One user message per line, one answer each, the conversation kept; ends at EOF (exit 0).

    With an image-text model, `images` go with the first message and a line `/image PATH` adds one to the
    next message; once a conversation has images, every turn goes through the processor.
    """
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    pending = list(images or [])
    with_images = bool(pending)
    interactive = getattr(lines, "isatty", lambda: False)()
    if interactive:
        hint = "; /image PATH adds an image to the next message" if generator.processor is not None else ""
        print(f"(one message per line{hint}; Ctrl-D ends)", file=sys.stderr)
    for line in lines:
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.startswith("/image "):
            if generator.processor is None:
                raise UserError("/image: the model is text-only, or chat was started without --image")
            pending.extend(read_images([text.removeprefix("/image ").strip()], "/image"))
            continue
        messages.append(generator.user_message(text, pending))
        with_images = with_images or bool(pending)
        pending = []
        if with_images:
            answer = generator.answer_with_images(messages)
        else:
            answer = generator.complete(generator.chat_ids(messages))
        messages.append({"role": "assistant", "content": answer})
        print(answer, file=out, flush=True)
    return 0
