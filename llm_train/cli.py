"""`llm-train`: the command-line tool around the training entry point.

    llm-train train --recipe NAME [...]     validate in this process, then `accelerate launch` train.py
                                            (processes from the recipe's hardware or --num-processes)
    llm-train recipes                       the shipped recipes, one line each
    llm-train show RECIPE [key=value ...]   the resolved recipe YAML and effective DeepSpeed JSON
    llm-train dry-run RECIPE [...]          same as train.py --dry-run
    llm-train convert RUN_DIR               a checkpoint's universal copy, ahead of a resume on a new layout

Each subcommand lives in its own small function; errors a user can cause are one line, exit 2.
That includes an optional dependency a command needs and this installation lacks: the line names
the pyproject extra that brings it.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from importlib import metadata

from llm_train.commands import convert, data, doctor, launch_train, plan, report
from llm_train.config.recipe import available_recipes, load_recipe
from llm_train.config.resolution import resolve_run
from llm_train.errors import EXIT_USER_ERROR, UserError
from llm_train.observability.console import print_recipe_table
from llm_train.runtime.export import export_checkpoint
from llm_train.train import main as train_main

DISTRIBUTION = "llm_train"


def cmd_recipes(args: argparse.Namespace) -> int:

    print_recipe_table(available_recipes())
    return 0


def cmd_show(args: argparse.Namespace) -> int:

    recipe = load_recipe(args.recipe, args.overrides)
    run = resolve_run(args.recipe, args.overrides, world_size=args.world_size or recipe.hardware.world_size)
    print(f"# recipe {run.recipe.name}\n{run.recipe_yaml()}")
    print(f"# DeepSpeed config {run.ds_path} (effective)\n{run.ds_json()}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    ckpt = convert.checkpoint_of(Path(args.checkpoint), "export")
    result = export_checkpoint(ckpt, Path(args.out), args.dtype)
    print(f"exported {ckpt} -> {args.out}: {result['tensors']} tensors, {args.dtype}; {result['verified']}")
    return 0


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:

    return launch_train.main(rest)


def cmd_dry_run(args: argparse.Namespace, rest: list[str]) -> int:

    return train_main(["--recipe", args.recipe, "--dry-run", *rest])


# Subcommands that hand their remaining arguments to another parser.
PASS_THROUGH: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {
    "train": cmd_train,
    "dry-run": cmd_dry_run,
}


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
    dry = sub.add_parser("dry-run", help="Print the resolved recipe, DS JSON, plan and memory estimate.")
    dry.add_argument("recipe")
    sub.add_parser("recipes", help="List the shipped recipes.").set_defaults(func=cmd_recipes)
    show = sub.add_parser("show", help="Show a recipe resolved, with its effective DeepSpeed JSON.")
    show.add_argument("recipe")
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
]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        if argv and argv[0] in PASS_THROUGH:
            known, rest = (
                parser.parse_known_args(argv) if argv[0] == "dry-run" else (argparse.Namespace(), argv[1:])
            )
            return PASS_THROUGH[argv[0]](known, rest)
        args = parser.parse_args(argv)
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
