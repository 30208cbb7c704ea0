"""docs/long-context.md's table: the longest sequence the planner fits per GPU count, without and
with DeepSpeed ALST (Ulysses sequence parallelism, tiled MLP, tiled loss, checkpoint offload).

Pure planner arithmetic (llm_train/planning/search/long_context.py states the assumptions): no GPU, no
download, under a second.

    .venv/bin/python -m bench.long_context_table [--model meta-llama/Llama-3.1-8B]
"""

from __future__ import annotations

import argparse

from llm_train.planning.search.long_context import long_context_table, render_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument(
        "--model", default="meta-llama/Llama-3.1-8B", help="A known model id or a local directory."
    )
    args = parser.parse_args()
    print(render_table(args.model, long_context_table(args.model)))


if __name__ == "__main__":
    main()
