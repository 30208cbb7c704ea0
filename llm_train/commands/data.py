"""`llm-train data prepare | inspect --recipe X`: tokenise ahead of time; look at what will be trained on.

    llm-train data prepare --recipe tiny-cpu-chat            tokenise + pack into data.cache_dir
    llm-train data inspect --recipe tiny-cpu-chat -n 3       statistics + 3 decoded samples, trained-on text in ⟦ ⟧
    llm-train data inspect --recipe tiny-cpu-grpo -n 3       objective grpo: the prompts as generation sees them

Both take recipe overrides (`data.seq_len=512`); prepare on a CPU box before GPU time is spent,
and training finds everything in the cache.
"""

from __future__ import annotations

import argparse
from typing import Any

from llm_train.config.objectives import objective_spec
from llm_train.config.recipe import load_recipe
from llm_train.data.dealer import EpochOrder
from llm_train.data.prepare import prepare_data
from llm_train.data.prompts import load_prompts
from llm_train.data.stream_windows import is_streaming
from llm_train.data.summary import describe_split, mapped_conversations, sample_views
from llm_train.runtime.model.model import load_tokenizer


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser("data", help="Prepare (tokenise + pack, cached) or inspect a recipe's data.")
    commands = data.add_subparsers(dest="data_command", required=True)
    prepare = commands.add_parser("prepare", help="Tokenise and pack the recipe's data into the cache.")
    inspect = commands.add_parser("inspect", help="Statistics and decoded samples, trained-on text marked.")
    for parser in (prepare, inspect):
        parser.add_argument("--recipe", required=True, help="A name in recipes/ or a YAML path.")
        parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="Recipe overrides.")
    inspect.add_argument(
        "-n", type=int, default=3, help="Samples (or preference pairs) to decode (default 3)."
    )
    prepare.set_defaults(func=cmd_prepare)
    inspect.set_defaults(func=cmd_inspect)


def _prepared(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    recipe = load_recipe(args.recipe, args.overrides)
    if is_streaming(recipe.data):
        print(
            f"data for recipe {recipe.name}: data.train is streamed (streaming: true); it is tokenised and "
            "packed while training, so there is nothing to prepare or inspect up front"
        )
        return recipe, None, None
    tokenizer = load_tokenizer(recipe.model)
    if objective_spec(recipe.objective).generates:
        _show_prompts(recipe, tokenizer, getattr(args, "n", 0))
        return recipe, None, None
    print(
        f"data for recipe {recipe.name}: seq_len {recipe.data.seq_len}, {recipe.data.packing}, cache {recipe.data.cache_dir}"
    )
    return recipe, tokenizer, prepare_data(recipe.data, tokenizer, recipe.optim.seed, say=print)


def _show_prompts(recipe: Any, tokenizer: Any, n: int) -> None:
    """objective grpo: prompts are read when the run starts (nothing to prepare); show them as generation sees them."""
    room = recipe.data.seq_len - recipe.grpo.max_completion_length
    print(
        f"data for recipe {recipe.name}: prompts of at most {room} tokens (objective grpo; nothing to prepare)"
    )
    parts = load_prompts(
        recipe.data,
        tokenizer,
        room,
        say=lambda m: print(f"  {m}"),
        template_kwargs=recipe.grpo.chat_template_kwargs,
    )
    for prompt in [p for part in parts for p in part][: max(0, n)]:
        print(
            f"\n{tokenizer.decode(prompt.ids)!r} ({len(prompt.ids)} tokens), fields for rewards: {prompt.columns}"
        )


def cmd_prepare(args: argparse.Namespace) -> int:

    _, _, prepared = _prepared(args)
    if prepared is None:
        return 0
    for split in (prepared.train, prepared.eval):
        if split is not None:
            print(describe_split(split)[-1])
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:

    recipe, tokenizer, prepared = _prepared(args)
    if prepared is None:
        return 0
    for split in (prepared.train, prepared.eval):
        if split is not None:
            print("\n".join(describe_split(split)))
    if mapped := mapped_conversations(recipe.data):
        print("\n" + "\n".join(mapped))
    train = prepared.train
    order = EpochOrder([p.n_sequences for p in train.parts], train.weights, recipe.optim.seed)
    per_sample = 2 if train.pairs else 1  # a preference pair shows its chosen and its rejected row
    views = sample_views(train, tokenizer, order, max(0, args.n) * per_sample)
    if views:
        what = f"{len(views) // 2} pairs (chosen, then rejected)" if train.pairs else f"{len(views)} samples"
        print(f"\nthe first {what} of epoch 0; text the model is trained to predict is in ⟦ ⟧")
        print("\n".join(views))
    return 0
