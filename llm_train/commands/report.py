"""`llm-train report RUN_DIR [RUN_DIR ...]`: PNG plots and a markdown summary (observability/run_report.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from llm_train.observability.run_report import make_report


def cmd_report(args: argparse.Namespace) -> int:
    summary, images = make_report([Path(p) for p in args.run_dirs], Path(args.out) if args.out else None)
    print(f"wrote {summary} and {len(images)} plots: {', '.join(p.name for p in images)}")
    print(summary.read_text().split("\n## ")[0])
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="Plot and summarise runs (loss, eval loss, lr, tokens/s, memory); several runs compare.",
    )
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="Run directories (with metrics.jsonl)."
    )
    parser.add_argument(
        "--out",
        help="Where to write report.md and the PNGs (default: RUN_DIR/report, or ./report for several).",
    )
    parser.set_defaults(func=cmd_report)
