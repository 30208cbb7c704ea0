"""Proves, without a GPU and without the GPU machine, that a folder of wheels completes that machine.

The GPU machine runs a fixed Python 3.12 image and reaches no package
registry. `tools/gpu_wheels/build.sh` (`make gpu-wheels`) fills `.whl/` with what the image lacks; there they
are installed with `pip install --no-index --no-deps --target DIR .whl/*.whl` and used with
`PYTHONPATH=DIR`. `--no-deps` means no resolver runs there, so nothing would tell us there that a
dependency is missing or at the wrong version: this module is that resolver, run here.

`check` reads every wheel's own METADATA and asserts:

- each wheel's tags install on CPython 3.12, manylinux x86_64 (a cp311 or macOS wheel is refused) and
  its Requires-Python admits 3.12;
- one version per project (two would overwrite each other in DIR, silently);
- every Requires-Dist (markers evaluated for CPython 3.12 on Linux x86_64, not for the Python running
  this check; requirements behind an extra only when that extra is asked for) is met by another wheel
  in the folder or by a package the image has (`tools/gpu_wheels/machine_packages.txt`);
- the folder stays under a size budget (it travels to that machine).

What the image has is only partly known. Each line of the packages file is a requirement: a bare
name means "present, version unknown"; a specifier says what is known (`torch==2.11.*`, or
`huggingface-hub>=1.5.0,<2.0` inferred from transformers 5.17's own requirement). A requirement
is tested at the *lowest* version the image may have, because the image is older than this
machine's set (torch 2.11 vs 2.13, transformers 5.17 vs 5.24): the risk is our wheels asking for
something newer than it has, not older. An unknown version is accepted and listed as an
assumption, so the report says what was not proven.

`resolve` is the second, independent route: pip's own resolver over the folder plus empty
stand-in wheels for the image's packages (at the same lowest versions), `--no-index`. pip
evaluates markers for the interpreter running it (3.11 here), which is why `check` is the gate
and `resolve` the cross-check.
"""

from __future__ import annotations

import argparse
import contextlib
import email.parser
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

# CPython 3.12 on Linux x86_64, as the GPU machine runs it.
TARGET_PYTHON = (3, 12)
TARGET_ENV: dict[str, str] = {
    **default_environment(),
    "implementation_name": "cpython",
    "implementation_version": "3.12.0",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_system": "Linux",
    "python_full_version": "3.12.0",
    "python_version": "3.12",
    "sys_platform": "linux",
}
# manylinux_2_28 and older: a CUDA 13 image has glibc >= 2.28, and pip downloads only these tags.
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
DEFAULT_BUDGET_MIB = 40.0


def target_tags() -> set[Tag]:
    """Every tag pip on the GPU machine accepts (cp312, abi3, none; manylinux x86_64 or any)."""
    tags = set(cpython_tags(TARGET_PYTHON, abis=["cp312"], platforms=PLATFORMS))
    tags.update(compatible_tags(TARGET_PYTHON, interpreter="cp312", platforms=PLATFORMS))
    return tags


@dataclass
class WheelInfo:
    """What `check` needs from one wheel: its name, version, tags, Requires-Python and Requires-Dist."""

    filename: str
    name: str
    version: Version
    tags: frozenset[Tag]
    requires_python: str | None
    requires: list[str]
    size: int = 0


@dataclass
class Report:
    """Errors fail the check; assumptions are what could not be proven (versions unknown there)."""

    errors: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    waived: list[str] = field(default_factory=list)
    total_bytes: int = 0
    # Projects a wheel of the lock's release would fix: a requirement no wheel and not the image meets, or an
    # image package whose own requirement a shipped wheel breaks (build.sh downloads these and checks again).
    missing: set[str] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return not self.errors


def read_wheel(path: Path) -> WheelInfo:
    """Name, version and tags from the file name (what pip matches on), the rest from METADATA."""
    name, version, _build, tags = parse_wheel_filename(path.name)
    with zipfile.ZipFile(path) as zf:
        metadata_names = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(metadata_names) != 1:
            raise ValueError(f"{path.name}: expected one *.dist-info/METADATA, found {len(metadata_names)}")
        message = email.parser.Parser().parsestr(zf.read(metadata_names[0]).decode("utf-8"))
    return WheelInfo(
        filename=path.name,
        name=name,
        version=version,
        tags=tags,
        requires_python=message.get("Requires-Python"),
        requires=message.get_all("Requires-Dist") or [],
        size=path.stat().st_size,
    )


def locked_versions(text: str) -> dict[str, str]:
    """requirements-lock.txt's pins: canonical name -> release."""
    return {canonicalize_name(n): v for n, v in re.findall(r"^([A-Za-z0-9_.\-]+)==([^\s;\\]+)", text, re.M)}


def read_present(lines: Iterable[str]) -> dict[str, SpecifierSet]:
    """The image's packages: canonical name -> what is known of its version there (may be empty)."""
    present: dict[str, SpecifierSet] = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            present[canonicalize_name(req.name)] = req.specifier
    return present


def lowest_version(spec: SpecifierSet) -> Version | None:
    """The lowest version `spec` allows by its lower bounds (`==2.11.*` -> 2.11), None if unbounded."""
    lows = []
    for s in spec:
        if s.operator in (">=", "==", "~=", "==="):
            lows.append(Version(s.version.removesuffix(".*")))
        elif s.operator == ">":
            lows.append(Version(s.version))  # strictly above; close enough to test a lower bound
    return max(lows) if lows else None


def read_image_requires(lines: Iterable[str]) -> dict[str, tuple[Version, list[str]]]:
    """The image's own packages' Requires-Dist (tools/gpu_wheels/image_requires.txt): `name==version: requirement`."""
    requires: dict[str, tuple[Version, list[str]]] = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if line:
            pin, _, requirement = line.partition(":")
            name, _, version = pin.strip().partition("==")
            entry = requires.setdefault(canonicalize_name(name), (Version(version), []))
            if requirement.strip():
                entry[1].append(requirement.strip())
    return requires


def check(wheels: list[WheelInfo], present: dict[str, SpecifierSet], waive: Iterable[str] = (),
          budget_mib: float = DEFAULT_BUDGET_MIB,
          image_requires: dict[str, tuple[Version, list[str]]] | None = None) -> Report:  # fmt: skip
    """Everything the module docstring lists, on already-read wheels (so tests need no files).

    `image_requires` holds what the image's own packages require: a wheel that travels shadows the image's
    copy of its project for every package there, so an image package that stays (tokenizers 0.23.2 requires
    huggingface-hub < 2.0) must accept the shipped release too, or travel at the lock's release itself."""
    report = Report(total_bytes=sum(w.size for w in wheels))
    waived = {canonicalize_name(n) for n in waive}
    tags = target_tags()
    by_name: dict[str, list[WheelInfo]] = {}
    for wheel in wheels:
        by_name.setdefault(canonicalize_name(wheel.name), []).append(wheel)
        if not wheel.tags & tags:
            shown = ", ".join(sorted(str(t) for t in wheel.tags))
            report.errors.append(
                f"{wheel.filename}: tags {shown} do not install on CPython 3.12 manylinux x86_64"
            )
        if wheel.requires_python and not SpecifierSet(wheel.requires_python).contains("3.12.0"):
            report.errors.append(f"{wheel.filename}: Requires-Python {wheel.requires_python} excludes 3.12")
    for name, versions in sorted(by_name.items()):
        if len(versions) > 1:
            files = ", ".join(sorted(w.filename for w in versions))
            report.errors.append(f"{name}: {len(versions)} wheels ({files}); keep one version")

    def satisfy(req: Requirement, needed_by: str) -> None:
        name = canonicalize_name(req.name)
        if name in by_name:
            wheel = by_name[name][0]
            if not req.specifier.contains(wheel.version, prereleases=True):
                report.errors.append(
                    f"{needed_by} requires {req}, but {wheel.filename} is version {wheel.version}"
                )
            for extra in req.extras:  # e.g. fsspec[http]: that wheel's requirements for the extra too
                follow(wheel, extra)
        elif name in present:
            known = present[name]
            low = lowest_version(known)
            if low is not None and not req.specifier.contains(low, prereleases=True):
                report.errors.append(
                    f"{needed_by} requires {req}, but the GPU machine may have {name} {low} "
                    f"(known there: {known}); ship a wheel or pick another version"
                )
                report.missing.add(name)
            elif low is None and str(req.specifier):
                report.assumptions.append(f"{needed_by} requires {req}; {name}'s version there is unknown")
        elif name in waived:
            report.waived.append(f"{needed_by} requires {req}: waived, not shipped")
        else:
            report.errors.append(f"{needed_by} requires {req}: no wheel here and not on the GPU machine")
            report.missing.add(name)

    def follow(wheel: WheelInfo, extra: str) -> None:
        for line in wheel.requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({**TARGET_ENV, "extra": extra}):
                # With an extra, only what the extra adds (the base was checked once already).
                if extra and (req.marker is None or req.marker.evaluate({**TARGET_ENV, "extra": ""})):
                    continue
                satisfy(req, f"{wheel.filename}" + (f"[{extra}]" if extra else ""))

    for wheel in wheels:
        follow(wheel, "")
    for image_name, (image_version, requires) in sorted((image_requires or {}).items()):
        if image_name in by_name:  # it travels: the shipped release's own requirements were checked above
            continue
        for line in requires:
            req = Requirement(line)
            shipped = by_name.get(canonicalize_name(req.name))
            if shipped is None or (
                req.marker is not None and not req.marker.evaluate({**TARGET_ENV, "extra": ""})
            ):
                continue
            if not req.specifier.contains(shipped[0].version, prereleases=True):
                report.errors.append(
                    f"the GPU machine's {image_name} {image_version} requires {req}, but "
                    f"{shipped[0].filename} shadows it there; ship {image_name} at the lock's release"
                )
                report.missing.add(image_name)
    budget = budget_mib * 2**20
    if report.total_bytes > budget:
        report.errors.append(
            f"total {report.total_bytes / 2**20:.1f} MiB is over the {budget_mib:g} MiB budget"
        )
    return report


def stand_in_versions(
    wheels: list[WheelInfo], present: dict[str, SpecifierSet], here: dict[str, str]
) -> dict[str, set[str]]:
    """Versions to offer pip for each of the image's packages, mirroring what `check` assumes.

    A known lower bound: that version only (the conservative end, as in `check`). Unknown: "any
    version", which pip cannot be told, so every version our wheels' requirements name for it
    (`fsspec<=2026.6.0` -> 2026.6.0) plus this machine's own; pip then picks one that fits all.
    """
    named: dict[str, set[str]] = {}
    for wheel in wheels:
        for line in wheel.requires:
            req = Requirement(line)
            named.setdefault(canonicalize_name(req.name), set()).update(s.version for s in req.specifier)
    versions: dict[str, set[str]] = {}
    for name, spec in present.items():
        low = lowest_version(spec)
        if low is not None:
            versions[name] = {str(low)}
        else:
            versions[name] = {v for v in named.get(name, set()) if "*" not in v} | (
                {here[name]} if name in here else set()
            )
            versions[name] = versions[name] or {"0"}
    return versions


def _stub_wheel(folder: Path, name: str, version: str) -> None:
    """An empty py3-none-any wheel that only says "name==version is installed" to pip's resolver."""
    dist = f"{canonicalize_name(name).replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as zf:
        zf.writestr(
            f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: gpu_wheels\nRoot-Is-Purelib: true\nTag: py3-none-any\n")  # fmt: skip
        zf.writestr(f"{dist}.dist-info/RECORD", "")


def resolve(folder: Path, stand_ins: dict[str, set[str]], roots: list[str]) -> list[str]:
    """pip's resolver, offline, over `folder` plus stand-ins for the image's packages; returns what it would install.

    Only pip's own options count: the environment's PIP_* settings and config files (extra
    indexes, find-links) are cut off, or the check would see more than the GPU machine has.
    """
    with tempfile.TemporaryDirectory() as tmp:
        stubs = Path(tmp) / "stubs"
        stubs.mkdir()
        for name, versions in stand_ins.items():
            for version in versions:
                _stub_wheel(stubs, name, version)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-index",
               "--disable-pip-version-check", "--find-links", str(folder), "--find-links", str(stubs),
               "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
               *[f"--platform={p}" for p in PLATFORMS], "--target", str(Path(tmp) / "target"),
               "--report", str(report), *roots]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"pip could not resolve {' '.join(roots)} offline:\n{done.stdout}{done.stderr}"
            )
        chosen = json.loads(report.read_text())["install"]
    return sorted(Path(item["download_info"]["url"]).name for item in chosen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the folder of wheels (.whl/)")
    parser.add_argument("--present", type=Path, required=True, help="the GPU machine's packages file")
    parser.add_argument("--waive", nargs="*", default=[], help="projects deliberately not shipped")
    parser.add_argument("--budget-mib", type=float, default=DEFAULT_BUDGET_MIB)
    parser.add_argument("--resolve", nargs="*", default=[], help="also resolve these roots with pip, offline")
    parser.add_argument("--image-requires", type=Path, help="the image's own packages' requirements")
    parser.add_argument(
        "--pins-for-missing",
        type=Path,
        metavar="LOCK",
        help="print the LOCK's pin of every project a wheel would fix (one a line) and exit: build.sh's closure",
    )
    args = parser.parse_args(argv)

    files = sorted(args.folder.glob("*"))
    strays = [f.name for f in files if f.suffix != ".whl"]
    wheels = [read_wheel(f) for f in files if f.suffix == ".whl"]
    present = read_present(args.present.read_text().splitlines())
    image_requires = (
        read_image_requires(args.image_requires.read_text().splitlines()) if args.image_requires else {}
    )
    report = check(wheels, present, args.waive, args.budget_mib, image_requires)
    if args.pins_for_missing:
        locked = locked_versions(args.pins_for_missing.read_text())
        unpinned = sorted(report.missing - locked.keys())
        if unpinned:
            print(
                f"gpu-wheels: {', '.join(unpinned)} must travel but the lock pins no release of it",
                file=sys.stderr,
            )
            return 2
        print("\n".join(f"{name}=={locked[name]}" for name in sorted(report.missing)))
        return 0
    report.errors.extend(f"{name}: not a wheel; the folder is installed as *.whl" for name in strays)

    for wheel in sorted(wheels, key=lambda w: w.name.lower()):
        print(f"  {wheel.size / 2**20:7.2f} MiB  {wheel.filename}")
    print(
        f"  {report.total_bytes / 2**20:7.2f} MiB  total ({len(wheels)} wheels; budget {args.budget_mib:g} MiB)"
    )
    for line in sorted(set(report.assumptions)):
        print(f"assumed: {line}")
    for line in sorted(set(report.waived)):
        print(f"waived: {line}")
    if not report.ok:
        for line in report.errors:
            print(f"gpu-wheels: {line}", file=sys.stderr)
        return 1
    print(
        f"gpu-wheels: {len(wheels)} wheels complete the GPU machine (Requires-Dist, tags, one version each)"
    )
    if args.resolve:
        from importlib.metadata import PackageNotFoundError, version

        here = {}
        for name in [*present, *map(canonicalize_name, args.waive)]:
            with contextlib.suppress(PackageNotFoundError):  # not installed here: no stand-in version
                here[name] = version(name)
        for name in args.waive:  # waived projects: a stand-in at this machine's version keeps pip quiet
            present.setdefault(canonicalize_name(name), SpecifierSet())
        chosen = resolve(args.folder, stand_in_versions(wheels, present, here), args.resolve)
        shipped = {w.filename for w in wheels}
        unused = sorted(shipped - set(chosen))
        print(
            f"gpu-wheels: pip resolves {' '.join(args.resolve)} offline from .whl/ and the image's stand-ins:"
        )
        for name in chosen:
            print(f"  {'shipped ' if name in shipped else 'on image'}  {name}")
        if unused:
            print(
                f"gpu-wheels: shipped but not needed by {' '.join(args.resolve)}: {', '.join(unused)}",
                file=sys.stderr,
            )
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
