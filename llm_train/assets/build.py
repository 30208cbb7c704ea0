"""Build the tiny bundled corpus, tokenizer, chat examples, preference pairs and RL prompts used by the tiny recipes.

The source text is ``pydoc_data.topics.topics`` (the Python language reference as plain text), which
ships with every CPython, so the assets can be rebuilt offline without downloading anything.

Usage::

    python -m llm_train.assets.build [--out DIR]

The output is byte-for-byte reproducible for a given Python / tokenizers / transformers version; the
versions are recorded in ``MANIFEST.json`` because ``pydoc_data.topics`` changes between Python releases.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent / "tiny"

VOCAB_SIZE = 4096
MIN_FREQUENCY = 2
# Model context of the tiny demo; only informs tokenizer warnings, recipes set their own block size.
MODEL_MAX_LENGTH = 2048
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
USER, ASSISTANT, SYSTEM = "<|user|>", "<|assistant|>", "<|system|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, USER, ASSISTANT, SYSTEM]

MAX_ANSWER_CHARS = 600
MAX_CHAT_EXAMPLES = 200
# Every SYSTEM_EVERY-th example gets a system message so the system-role path is exercised too.
SYSTEM_EVERY = 10
SYSTEM_PROMPT = "You are a concise assistant that explains the Python language reference."

# Roles are rendered as their marker token on its own line; every message ends with <|eos|> so the
# model learns to stop after an assistant turn. The {% generation %} block lets transformers build an
# assistant-only loss mask (apply_chat_template(..., return_assistant_tokens_mask=True)).
# Kept as literal Jinja (raw string: Jinja itself turns the '\n' escapes into newlines).
CHAT_TEMPLATE = r"""{{- '<|bos|>' -}}
{%- for message in messages -%}
    {%- if message['role'] not in ['system', 'user', 'assistant'] -%}
        {{- raise_exception('Unsupported chat role: ' + message['role']) -}}
    {%- endif -%}
    {{- '<|' + message['role'] + '|>\n' -}}
    {%- if message['role'] == 'assistant' -%}
        {%- generation -%}{{- message['content'] + '<|eos|>' -}}{%- endgeneration -%}
    {%- else -%}
        {{- message['content'] + '<|eos|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>\n' -}}
{%- endif -%}
"""

_HEADING_UNDERLINE = set("*=-~^")
_VERSION_NOTE = re.compile(r"(New|Changed|Added|Deprecated) (in|since) version ")
# Closing quotes/brackets may follow the full stop; \u201d and \u2019 are the curly quotes the docs use.
_SENTENCE_END = re.compile("[.!?][\"'\u201d\u2019)\\]]*(?=\\s)")


def normalise(text: str) -> str:
    """Strip trailing spaces on every line and collapse runs of blank lines to a single one."""
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


def load_topics() -> list[tuple[str, str]]:
    """Return ``(key, normalised text)`` for every pydoc topic in sorted key order."""
    from pydoc_data.topics import topics

    return [(key, normalise(topics[key])) for key in sorted(topics)]


def build_corpus(topics: Sequence[tuple[str, str]]) -> str:
    """All topic texts, one blank line between topics, ending in a single newline."""
    return "\n\n".join(text for _, text in topics if text) + "\n"


def split_sections(text: str) -> Iterator[tuple[str, str]]:
    """Yield ``(title, body)`` for each reStructuredText-style heading (title + same-length underline)."""
    lines = text.split("\n")
    starts: list[int] = []
    for i in range(1, len(lines)):
        line, prev = lines[i], lines[i - 1]
        if (
            line
            and len(set(line)) == 1
            and line[0] in _HEADING_UNDERLINE
            and len(line) == len(prev)
            and prev.strip()
        ):
            starts.append(i - 1)
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        yield lines[start].strip(), "\n".join(lines[start + 2 : end]).strip("\n")


def _cut_paragraph(paragraph: str, limit: int) -> str:
    """Shorten one over-long paragraph, preferring a sentence end, then a line end, then a word end."""
    head = paragraph[: limit + 1]
    sentence_ends = [m.end() for m in _SENTENCE_END.finditer(head) if m.end() <= limit]
    # A sentence cut that keeps less than a third of the budget reads worse than a line cut.
    if sentence_ends and sentence_ends[-1] >= limit // 3:
        return head[: sentence_ends[-1]]
    newline = head.rfind("\n", 0, limit)
    if newline > 0:
        return head[:newline].rstrip()
    space = head.rfind(" ", 0, limit)
    return head[: space if space > 0 else limit].rstrip()


def summarise(body: str, limit: int = MAX_ANSWER_CHARS) -> str:
    """First paragraph(s) of ``body``, at most ``limit`` characters, cut at a sentence or line boundary."""
    # Version notes ("New in version 3.5.") say nothing about what the feature is; leave them out.
    paragraphs = [p for p in body.split("\n\n") if p.strip() and not _VERSION_NOTE.match(p)]
    if not paragraphs:
        return ""
    kept: list[str] = []
    for paragraph in paragraphs:
        candidate = "\n\n".join([*kept, paragraph])
        if len(candidate) > limit:
            break
        kept.append(paragraph)
    if not kept:
        return _cut_paragraph(paragraphs[0], limit)
    answer = "\n\n".join(kept)
    # A trailing "...as follows:" whose example was cut off leaves a dangling answer: drop that
    # paragraph, or (if it is the only one) its last sentence.
    if len(kept) < len(paragraphs) and answer.endswith(":"):
        if len(kept) > 1:
            answer = "\n\n".join(kept[:-1])
        else:
            shorter = _cut_paragraph(answer, len(answer) - 1)
            answer = shorter if shorter.endswith((".", "!", "?")) else answer
    return answer


def build_chat(topics: Sequence[tuple[str, str]]) -> list[dict[str, list[dict[str, str]]]]:
    """One question per section: the topic key for a topic's top section, the heading for sub-sections."""
    examples: list[dict[str, list[dict[str, str]]]] = []
    seen: set[str] = set()
    for key, text in topics:
        for index, (title, body) in enumerate(split_sections(text)):
            subject = key if index == 0 else title
            answer = summarise(body)
            if not answer or subject.lower() in seen:
                continue
            seen.add(subject.lower())
            messages = [
                {"role": "user", "content": f"Explain the Python topic '{subject}'."},
                {"role": "assistant", "content": answer},
            ]
            if len(examples) % SYSTEM_EVERY == 0:
                messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
            examples.append({"messages": messages})
            if len(examples) == MAX_CHAT_EXAMPLES:
                return examples
    return examples


def build_preferences(chat: Sequence[dict[str, list[dict[str, str]]]]) -> list[dict[str, Any]]:
    """Preference pairs in the shape of HuggingFaceH4/ultrafeedback_binarized (train_prefs), from the chat examples.

    Each keeps its question as ``prompt``; ``chosen`` and ``rejected`` are whole conversations
    (the user turn, then an assistant turn): chosen answers with the reference text, rejected with
    the same text whose words are shuffled within each line (indentation and line breaks kept).
    Same words, same layout, one difference a tiny model can learn from the corpus: word order, so a
    preference run on it shows held-out reward accuracy rise (``tiny-cpu-dpo``). The shuffle is
    seeded by the question, so the file is reproducible.
    """
    import random

    pairs: list[dict[str, Any]] = []
    for example in chat:
        user, answer = [m for m in example["messages"] if m["role"] != "system"]
        rng = random.Random(user["content"])
        lines = []
        for line in answer["content"].split("\n"):
            words = line.split()
            rng.shuffle(words)
            lines.append(line[: len(line) - len(line.lstrip())] + " ".join(words))
        rejected = "\n".join(lines)
        if rejected == answer["content"]:  # nothing to tell apart (one word per line, or an unlucky shuffle)
            continue
        pairs.append(
            {
                "prompt": user["content"],
                "chosen": [user, {"role": "assistant", "content": answer["content"]}],
                "rejected": [user, {"role": "assistant", "content": rejected}],
            }
        )
    return pairs


def build_prompts(chat: Sequence[dict[str, list[dict[str, str]]]]) -> list[dict[str, str]]:
    """Prompts for online RL (``format: prompt``): each chat example's question, with its topic as a column.

    ``tiny-cpu-grpo`` rewards a completion that contains a digit: a random tiny model writes one in about a
    quarter of its completions (58 of the tokenizer's 4,096 tokens hold a digit), so the groups' rewards
    differ from the first step and the policy gradient has something to push on.
    """
    prompts = []
    for example in chat:
        user = next(m for m in example["messages"] if m["role"] == "user")
        topic = user["content"].split("'")[1] if user["content"].count("'") >= 2 else ""
        prompts.append({"prompt": user["content"], "topic": topic})
    return prompts


def train_tokenizer(corpus_path: Path, out_dir: Path) -> None:
    """Train a byte-level BPE on the corpus and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False keeps decode(encode(x)) == x exactly (no synthetic leading space).
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=MIN_FREQUENCY,
        special_tokens=SPECIAL_TOKENS,
        # Seed all 256 byte symbols so any input (not just corpus characters) is encodable without <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # No thread pinning needed: with tokenizers 0.23.3 the saved files were byte-identical across fresh
    # processes run with RAYON_NUM_THREADS=1, 2, 8, 16 and 32 (the reproducibility test guards this).
    tokenizer.train([str(corpus_path)], trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        # The role markers are not passed as additional/extra special tokens: the trainer already made
        # them special added tokens in tokenizer.json, and v5's list-valued "extra_special_tokens" in the
        # config is not understood by transformers 4.x (which pyproject still allows).
        model_max_length=MODEL_MAX_LENGTH,
        # Cleanup would alter spaces before punctuation and break exact round-tripping.
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))

    # transformers 5 records its internal "TokenizersBackend" class, which 4.x cannot resolve; the
    # public alias loads with both.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_text(config_path, json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_text(path: Path, text: str) -> None:
    # newline="" stops Windows from turning "\n" into "\r\n" and changing the hashes.
    with path.open("w", encoding="utf-8", newline="") as f:
        f.write(text)


def build(out: Path) -> dict[str, Any]:
    """Write all assets into ``out`` (replacing a previous tokenizer) and return the manifest."""
    import tokenizers
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    topics = load_topics()

    corpus = build_corpus(topics)
    _write_text(out / "corpus.txt", corpus)

    chat = build_chat(topics)
    _write_text(
        out / "chat.jsonl",
        "".join(json.dumps(example, ensure_ascii=False) + "\n" for example in chat),
    )
    preferences = build_preferences(chat)
    _write_text(
        out / "preferences.jsonl",
        "".join(json.dumps(pair, ensure_ascii=False) + "\n" for pair in preferences),
    )

    prompts = build_prompts(chat)
    _write_text(out / "prompts.jsonl", "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in prompts))

    # Start from an empty folder so stale files (e.g. from another transformers layout) do not linger.
    tok_dir = out / "tokenizer"
    if tok_dir.exists():
        shutil.rmtree(tok_dir)
    train_tokenizer(out / "corpus.txt", tok_dir)

    # Only hash what this script wrote, so unrelated files in a custom --out folder stay out.
    files = [
        out / "chat.jsonl",
        out / "corpus.txt",
        out / "preferences.jsonl",
        out / "prompts.jsonl",
        *sorted(p for p in tok_dir.rglob("*") if p.is_file()),
    ]
    manifest: dict[str, Any] = {
        "source": "pydoc_data.topics",
        "python_version": platform.python_version(),
        "tokenizers_version": tokenizers.__version__,
        "transformers_version": transformers.__version__,
        "vocab_size": VOCAB_SIZE,
        "corpus_chars": len(corpus),
        "chat_examples": len(chat),
        "preference_pairs": len(preferences),
        "prompt_rows": len(prompts),
        "files": {p.relative_to(out).as_posix(): _sha256(p) for p in files},
    }
    _write_text(out / "MANIFEST.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def main(argv: Sequence[str | os.PathLike[str]] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build the tiny bundled corpus, tokenizer, chat examples and preference pairs."
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})"
    )
    args = parser.parse_args(None if argv is None else [str(a) for a in argv])
    manifest = build(args.out)
    print(
        f"wrote {args.out}: {manifest['corpus_chars']} chars, {manifest['chat_examples']} chat examples, "
        f"{manifest['preference_pairs']} preference pairs"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
