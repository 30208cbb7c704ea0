"""Build the tiny bundled lm-eval task (`llm_train_tiny`): word-order items from the bundled corpus.

`llm-train eval` and periodic evaluation need a task that runs offline in CI on CPU against the
demo's model: lm-eval's YAML tasks over local files are that (its `custom_dataset` loads them
relative to the task folder, so the task works from any directory and with lm-eval's own CLI:
`lm_eval --include_path llm_train/assets/eval_tasks --tasks llm_train_tiny ...`).

Each item is a passage of the corpus cut after CONTEXT_WORDS words; the answer is its next
CHOICE_WORDS words, the three distractors the same words in other orders (the same tokens, about
the same length, so lm-eval's acc and acc_norm agree). Chance is 25%. Measured (32 items,
2026-12-02): the tiny-cpu demo's model after its 200 steps 0.8125 +- 0.07, the same model after 2
steps 0.3125 +- 0.08. Usage: python -m llm_train.assets.eval_task
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from llm_train.assets.build import DEFAULT_OUT

TASKS_DIR = Path(__file__).resolve().parent / "eval_tasks"
TASK = "llm_train_tiny"
ITEMS = 32
CONTEXT_WORDS = 10
CHOICE_WORDS = 5
SEED = 0


def build_items(corpus: str) -> list[dict[str, object]]:
    """The task's items: question (context), four choices, the index of the true continuation."""
    paragraphs = [p.split() for p in corpus.split("\n\n")]
    usable = [w for w in paragraphs if len(w) >= CONTEXT_WORDS + CHOICE_WORDS and "::=" not in w]
    rng = random.Random(SEED)
    items = []
    for words in rng.sample(usable, ITEMS):
        context, true = words[:CONTEXT_WORDS], words[CONTEXT_WORDS : CONTEXT_WORDS + CHOICE_WORDS]
        choices = [" ".join(true)]
        while len(choices) < 4:  # the same words in another order: same tokens, same length
            shuffled = rng.sample(true, len(true))
            if " ".join(shuffled) not in choices:
                choices.append(" ".join(shuffled))
        order = list(range(4))
        rng.shuffle(order)
        items.append(
            {"question": " ".join(context), "choices": [choices[k] for k in order], "answer": order.index(0)}
        )
    return items


def main() -> int:
    corpus = (DEFAULT_OUT / "corpus.txt").read_text(encoding="utf-8")
    path = TASKS_DIR / f"{TASK}.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in build_items(corpus)), encoding="utf-8")
    print(f"wrote {ITEMS} items to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
