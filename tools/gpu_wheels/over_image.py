"""Which of the GPU image's libraries must travel at the lock's release: prints `name==version`, one a line.

    python -m tools.gpu_wheels.over_image --present tools/gpu_wheels/machine_packages.txt \
        --lock requirements-lock.txt transformers accelerate peft ...

A named library travels when the image has it (tools/gpu_wheels/machine_packages.txt) at a release other
than the lock's, or at one not known exactly (a bare name, a range): the run there must use the set the
suite passed on. One the image lacks, or has at exactly the lock's release, does not; one the lock does
not pin is an error (exit 2), since then nothing says which release was tested.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from tools.gpu_wheels.check import locked_versions, read_present


def exactly(spec: SpecifierSet) -> str | None:
    """The one release `spec` names (`==5.17.0`), or None when it admits more than one or is unknown."""
    only = list(spec)
    if len(only) != 1 or only[0].operator not in ("==", "===") or "*" in only[0].version:
        return None
    return only[0].version


def over_image(names: list[str], present: dict[str, SpecifierSet], locked: dict[str, str]) -> list[str]:
    pins = []
    for name in names:
        key = canonicalize_name(name)
        if key not in locked:
            raise SystemExit(f"over_image: {name} is not pinned in the lock; add it or drop it from the list")
        if key in present and exactly(present[key]) != locked[key]:
            pins.append(f"{name}=={locked[key]}")
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--present", type=Path, required=True, help="the GPU machine's packages file")
    parser.add_argument("--lock", type=Path, required=True, help="requirements-lock.txt")
    parser.add_argument("names", nargs="+", help="libraries that must run at the lock's release there")
    args = parser.parse_args(argv)
    present = read_present(args.present.read_text().splitlines())
    print("\n".join(over_image(args.names, present, locked_versions(args.lock.read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
