"""`make gpu-wheels` on the lock, without a registry: a lock refresh that would break the GPU install fails here.

tools/gpu_wheels/build.sh downloads the lock's releases of what the image lacks (lacking.txt), of the libraries
whose internals llm_train touches where the image has another release (over_image.py), and llm_train itself,
then closes the set: whatever those need that the image does not meet travels too (check.py's `missing`). The
same closure runs here on this .venv's installed metadata, which `make install` constrains to the lock, so the
requirements are the wheels' own. What only the real files show (tags, sizes against the budget) stays in
`make gpu-wheels`; liger-kernel (not in the lock: it needs a GPU) needs only torch and triton, both on the image.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from packaging.tags import parse_tag
from packaging.utils import canonicalize_name
from packaging.version import Version

from llm_train.runtime.base.compat import WINDOWS
from tools.gpu_wheels import check as gpu_wheels
from tools.gpu_wheels.over_image import over_image

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools" / "gpu_wheels"
LOCKED = gpu_wheels.locked_versions((REPO / "requirements-lock.txt").read_text())
PRESENT = gpu_wheels.read_present((TOOLS / "machine_packages.txt").read_text().splitlines())
IMAGE_REQUIRES = gpu_wheels.read_image_requires((TOOLS / "image_requires.txt").read_text().splitlines())


def installed_wheel(pin: str) -> gpu_wheels.WheelInfo:
    """The wheel `pin` (name==version) would be, as far as its metadata goes, read from this .venv."""
    name, _, version = pin.partition("==")
    here = importlib.metadata.version(name)
    if here != version:
        pytest.fail(f"{name} {here} is installed but the lock pins {version}: run `make install`")
    return gpu_wheels.WheelInfo(
        filename=f"{name}-{version}-py3-none-any.whl",
        name=name,
        version=Version(version),
        tags=frozenset(parse_tag("py3-none-any")),  # tags are checked on the real files only
        requires_python=None,
        requires=importlib.metadata.requires(name) or [],
    )


def lacking() -> list[str]:
    lines = (TOOLS / "lacking.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_the_locks_wheels_close_over_the_gpu_image() -> None:
    roots = [f"{n}=={LOCKED[canonicalize_name(n)]}" for n in lacking()]
    roots += over_image([w.library for w in WINDOWS], PRESENT, LOCKED)
    wheels = [installed_wheel(pin) for pin in roots]
    wheels.append(installed_wheel(f"llm-train=={importlib.metadata.version('llm-train')}"))
    added: list[str] = []
    for _ in range(8):  # build.sh's closure: each round ships what the last one needed
        report = gpu_wheels.check(wheels, PRESENT, waive=["wandb"], image_requires=IMAGE_REQUIRES)
        if not report.missing:
            break
        unpinned = sorted(report.missing - LOCKED.keys())
        assert not unpinned, f"must travel but the lock pins no release: {unpinned}"
        pins = [f"{name}=={LOCKED[name]}" for name in sorted(report.missing)]
        added += pins
        wheels += [installed_wheel(pin) for pin in pins]
    assert report.ok, report.errors
    # The lock's transformers 5.25 needs the hub 2.x family over the image's 1.33 (and tokenizers with it):
    # the set build.sh printed on 2026-12-06. A refresh that changes it shows here, and in `make gpu-wheels`.
    assert {pin.split("==")[0] for pin in added} >= {"huggingface-hub", "kernels", "tokenizers", "httpx2"}
