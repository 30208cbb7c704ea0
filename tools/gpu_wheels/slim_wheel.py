"""A copy of a wheel without the shared libraries one machine will never load.

bitsandbytes' wheel (41 MiB) carries a compiled library per CUDA and ROCm version; the GPU
machine (CUDA 13.0) loads `libbitsandbytes_cuda130.so` (bitsandbytes picks the library matching
torch.version.cuda) and, without a GPU, `libbitsandbytes_cpu.so`. The rest would only eat the
64 MiB that may travel there. The copy keeps the wheel's name and every other file; the dropped
files' lines leave its RECORD, so what pip installs is what RECORD lists.

    python tools/gpu_wheels/slim_wheel.py WHEEL --keep 'libbitsandbytes_(cpu|cuda130)\\.so$' --drop '\\.so$' -o DIR
"""

from __future__ import annotations

import argparse
import re
import zipfile
from pathlib import Path


def slim(wheel: Path, out_dir: Path, drop: str, keep: str) -> tuple[Path, list[str]]:
    """Write out_dir/<wheel's name> without the members matching `drop` unless they match `keep`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel.name
    dropped: list[str] = []
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dest:
        names = source.namelist()
        gone = {n for n in names if re.search(drop, n) and not re.search(keep, n)}
        for name in names:
            if name in gone:
                dropped.append(name)
                continue
            data = source.read(name)
            if name.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = (
                    "\n".join(line for line in lines if line.split(",", 1)[0] not in gone) + "\n"
                ).encode()
            dest.writestr(source.getinfo(name), data)
    return target, dropped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--drop", required=True, help="Regex of members to leave out.")
    parser.add_argument("--keep", default=r"(?!)", help="Regex of members kept although --drop matches.")
    parser.add_argument("-o", "--out", type=Path, required=True, help="Folder for the slimmed copy.")
    args = parser.parse_args()
    target, dropped = slim(args.wheel, args.out, args.drop, args.keep)
    before, after = args.wheel.stat().st_size / 2**20, target.stat().st_size / 2**20
    print(f"slim_wheel: {target.name}: {before:.1f} -> {after:.1f} MiB, {len(dropped)} files left out")


if __name__ == "__main__":
    main()
