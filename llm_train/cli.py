"""`llm-train`: the command-line tool around the training entry point.

    llm-train train --recipe NAME [...]     validate in this process, then `accelerate launch` train.py
                                            (processes from the recipe's hardware or --num-processes)
    llm-train recipes                       the shipped recipes, one line each
    llm-train show RECIPE [key=value ...]   the resolved recipe YAML and effective DeepSpeed JSON
    llm-train show --schema                 every recipe key: type, default, description (docs/recipe.md)
    llm-train dry-run RECIPE [...]          same as train.py --dry-run
    llm-train convert RUN_DIR               a checkpoint's universal copy, ahead of a resume on a new layout

Each subcommand lives in its own small function; errors a user can cause are one line, exit 2.
Every subcommand takes its key.sub=value overrides anywhere among its options (`parse_command`).
That includes an optional dependency a command needs and this installation lacks: the line names
the pyproject extra that brings it.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from importlib import metadata

from llm_train.commands import convert, data, doctor, generate, plan, report
from llm_train.commands import eval as eval_command
from llm_train.commands import train as train_command
from llm_train.commands.recipes import cmd_recipes
from llm_train.config.recipe import load_recipe
from llm_train.config.recipe_reference import REGENERATE, recipe_reference
from llm_train.config.resolution import resolve_run
from llm_train.errors import EXIT_USER_ERROR, UserError
from llm_train.runtime.base.compat import hub_kernels_off
from llm_train.runtime.export.from_checkpoint import export_checkpoint
from llm_train.train import build_parser as train_parser
from llm_train.train import main as train_main

DISTRIBUTION = "llm_train"


def cmd_show(args: argparse.Namespace) -> int:

    if args.schema:
        if args.recipe or args.overrides:
            raise UserError("show --schema: the reference of every recipe key takes no recipe or overrides")
        print(recipe_reference(), end="")
        return 0
    if not args.recipe:
        raise UserError(
            "show: name a recipe (llm-train recipes lists them), or pass --schema for the reference"
        )
    recipe = load_recipe(args.recipe, args.overrides)
    run = resolve_run(args.recipe, args.overrides, world_size=args.world_size or recipe.hardware.world_size)
    print(f"# recipe {run.recipe.name}\n{run.recipe_yaml()}")
    print(f"# DeepSpeed config {run.ds_path} (effective)\n{run.ds_json()}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    ckpt = convert.checkpoint_of(Path(args.checkpoint), "export")
    result = export_checkpoint(ckpt, Path(args.out), args.dtype, merge=args.merge)
    # A LoRA checkpoint gives its adapter in the dtype it trained in, whatever --dtype asked: say what was written.
    print(
        f"exported {ckpt} -> {args.out}: {result['tensors']} tensors, {result['dtype']}; {result['verified']}"
    )
    return 0


def cmd_dry_run(args: argparse.Namespace) -> int:

    args.dry_run = True
    return train_main([], args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-train", description="DeepSpeed + Accelerate LLM training recipes."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "train",
        help="Validate, then `accelerate launch` a recipe (arguments as llm_train/train.py, plus "
        "--num-processes, --num-machines, --max-restarts; see `llm-train train --help`).",
        add_help=False,
    )
    sub.add_parser(
        "dry-run",
        parents=[train_parser(recipe_positional=True, add_help=False)],
        help="Print the resolved recipe, DS JSON, plan and memory estimate (arguments as train.py's).",
    ).set_defaults(func=cmd_dry_run)
    sub.add_parser("recipes", help="List the shipped recipes.").set_defaults(func=cmd_recipes)
    show = sub.add_parser(
        "show",
        help="Show a recipe resolved, with its effective DeepSpeed JSON (or --schema: every recipe key).",
    )
    show.add_argument("recipe", nargs="?")
    show.add_argument(
        "--schema", action="store_true", help=f"Print the recipe reference (docs/recipe.md: {REGENERATE})."
    )
    show.add_argument(
        "--world-size", type=int, help="Resolve for this many processes (default: the recipe's)."
    )
    show.add_argument("overrides", nargs="*", metavar="key.sub=value")
    show.set_defaults(func=cmd_show)
    export = sub.add_parser("export", help="A plain Hugging Face model directory from a checkpoint.")
    export.add_argument(
        "checkpoint", help="checkpoints/step-N of a run, or a run directory (its newest checkpoint)."
    )
    export.add_argument("out", help="Output directory (must be new or empty).")
    export.add_argument(
        "--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="Weight dtype (default bf16)."
    )
    export.add_argument(
        "--merge",
        action="store_true",
        help="A LoRA checkpoint: fold its adapters into the pretrained base it was trained from (which must "
        "load here: a local directory or the hub cache) and write a plain model; without it, the adapter.",
    )
    export.set_defaults(func=cmd_export)
    for register in _EXTENSIONS:
        register(sub)
    return parser


# The other subcommands live in commands/, one module each; each registers its own parser. They
# are imported like any module (a broken one fails loudly, never silently disappears), and
# optional extras (matplotlib, peft, tensorboard) are imported only when their command runs,
# which then names the missing extra in one line.
_EXTENSIONS: list[Callable[[argparse._SubParsersAction], None]] = [
    plan.register_cli,
    doctor.register_cli,
    report.register_cli,
    data.register_cli,
    convert.register_cli,
    generate.register_cli,
    eval_command.register_cli,
]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    hub_kernels_off()  # generate, chat, export and eval load models too (compat.py says why)
    parser = build_parser()
    try:
        if argv and argv[0] == "train":
            # Its own flags and train.py's: commands/train.py splits them and hands the rest on.
            return train_command.main(argv[1:])
        args = parse_command(parser, argv)
        return args.func(args)
    except UserError as exc:
        print(f"llm-train: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except ModuleNotFoundError as exc:
        fix = missing_dependency_fix(exc.name or "")
        if fix is None:
            raise  # not a package this installation should have: a bug, keep its traceback
        print(f"llm-train {argv[0] if argv else ''}: needs {exc.name}; {fix}", file=sys.stderr)
        return EXIT_USER_ERROR


def parse_command(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)`, except that a subcommand's positionals may stand among its options.

    argparse parses a subcommand with plain `parse_known_args`: a nargs="*" positional (the
    key.sub=value overrides) takes only the first run of them, and any after the next option are
    "unrecognized". `parse_intermixed_args` collects them all, in their order, but refuses a parser
    that has subcommands: so the subcommand is picked here by its name and its own parser parses
    the rest intermixed (nested subcommands, as in `data prepare`, the same way).
    """
    subparsers = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if subparsers is None:
        return parser.parse_intermixed_args(argv)
    if not argv or argv[0] not in subparsers.choices:
        return parser.parse_args(argv)  # argparse's own answer: -h, a missing or unknown subcommand
    args = parse_command(subparsers.choices[argv[0]], argv[1:])
    setattr(args, subparsers.dest, argv[0])
    return args


def missing_dependency_fix(module: str) -> str | None:
    """How to install the distribution that provides `module`, from llm_train's own metadata.

    Read from the installed package's requirements (pyproject.toml's dependencies and extras), so
    the extras named here are always the ones pyproject.toml defines. None: not ours to require.
    """
    wanted = _normalise(module.split(".")[0])
    try:
        requirements = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return None
    for requirement in requirements:
        name = _normalise(re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0])
        if name != wanted or name == _normalise(DISTRIBUTION):  # an extra that includes another extra
            continue
        extra = re.search(r"extra\s*==\s*[\"']([^\"']+)[\"']", requirement)
        if extra is None:
            return f"it is a dependency of {DISTRIBUTION}: reinstall it (pip install -e . in a checkout)"
        if extra.group(1) == "dev":
            return None
        return f"pip install '{DISTRIBUTION}[{extra.group(1)}]'"
    return None


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


if __name__ == "__main__":
    sys.exit(main())
