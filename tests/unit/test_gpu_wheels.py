"""The completeness check of `make gpu-wheels` (tools/gpu_wheels/check.py), on synthetic wheels.

The real download needs a registry and stays in `make gpu-wheels`; these tests keep the checking
logic honest without one: each rule is shown to pass a good set and to name the fault in a bad one.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from packaging.tags import parse_tag
from packaging.version import Version

from tools.gpu_wheels import check as gpu_wheels
from tools.gpu_wheels.slim_wheel import slim

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools" / "gpu_wheels"

PRESENT = gpu_wheels.read_present(
    [
        "torch==2.11.*",
        "huggingface-hub>=1.5.0,<2.0  # capped by transformers there",
        "numpy",
        "typing-extensions",
    ]
)


def wheel(name: str, version: str, *requires: str, tag: str = "py3-none-any", size: int = 1000,
          requires_python: str | None = ">=3.10") -> gpu_wheels.WheelInfo:  # fmt: skip
    return gpu_wheels.WheelInfo(
        filename=f"{name}-{version}-{tag}.whl",
        name=name,
        version=Version(version),
        tags=frozenset(parse_tag(tag)),
        requires_python=requires_python,
        requires=list(requires),
        size=size,
    )


GOOD = [
    wheel(
        "llm_train", "0.1.0", "torch>=2.4", "deepspeed>=0.16", "pydantic>=2.6", "pytest>=8; extra == 'dev'"
    ),
    wheel("deepspeed", "0.19.8", "torch", "numpy", "pydantic>=2.0.0"),
    wheel("pydantic", "2.14.4", "pydantic-core==2.50.5", "typing-extensions>=4.16.0"),
    wheel("pydantic_core", "2.50.5", tag="cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64"),
    wheel("typing_extensions", "4.16.0"),
    wheel("multiprocess", "0.70.19", tag="py312-none-any"),
]


def test_a_complete_set_passes_and_lists_unknown_versions_as_assumptions() -> None:
    report = gpu_wheels.check(GOOD, PRESENT)
    assert report.errors == []
    # deepspeed's bare `numpy` needs no assumption; nothing in GOOD pins numpy, so none is listed.
    assert report.assumptions == []
    assert report.total_bytes == 1000 * len(GOOD)


def test_a_requirement_neither_shipped_nor_on_the_machine_is_reported() -> None:
    wheels = [w for w in GOOD if w.name != "pydantic_core"]
    errors = gpu_wheels.check(wheels, PRESENT).errors
    assert errors == [
        "pydantic-2.14.4-py3-none-any.whl requires pydantic-core==2.50.5: no wheel here and not on the GPU machine"
    ]


def test_a_shipped_wheel_at_the_wrong_version_is_reported() -> None:
    wheels = [w for w in GOOD if w.name != "pydantic_core"]
    wheels.append(wheel("pydantic_core", "2.50.4", tag="cp312-cp312-manylinux_2_17_x86_64"))
    errors = gpu_wheels.check(wheels, PRESENT).errors
    assert len(errors) == 1 and "requires pydantic-core==2.50.5" in errors[0] and "2.50.4" in errors[0]


def test_two_versions_of_one_project_are_reported() -> None:
    wheels = [*GOOD, wheel("typing-extensions", "4.15.0")]
    errors = gpu_wheels.check(wheels, PRESENT).errors
    assert any(e.startswith("typing-extensions: 2 wheels") for e in errors), errors


@pytest.mark.parametrize(
    "tag",
    [
        "cp311-cp311-manylinux_2_17_x86_64",  # another Python
        "cp312-cp312-macosx_11_0_arm64",  # another platform
        "cp312-cp312-manylinux_2_34_x86_64",  # newer glibc than the downloads allow
        "cp312-cp312-linux_x86_64",  # a local build, not portable
    ],
)
def test_a_wheel_that_does_not_install_on_cpython_312_manylinux_is_reported(tag: str) -> None:
    wheels = [w for w in GOOD if w.name != "pydantic_core"] + [wheel("pydantic_core", "2.50.5", tag=tag)]
    errors = gpu_wheels.check(wheels, PRESENT).errors
    assert len(errors) == 1 and "do not install on CPython 3.12" in errors[0], errors


def test_requires_python_that_excludes_312_is_reported() -> None:
    errors = gpu_wheels.check([wheel("hjson", "3.1.0", requires_python=">=3.13")], PRESENT).errors
    assert errors == ["hjson-3.1.0-py3-none-any.whl: Requires-Python >=3.13 excludes 3.12"]


def test_a_requirement_above_the_lowest_version_the_machine_may_have_is_reported() -> None:
    # datasets >= 5.1 wants huggingface-hub >= 1.31; transformers 5.17 there allows any 1.x from 1.5.
    errors = gpu_wheels.check([wheel("datasets", "5.2.0", "huggingface-hub<3.0,>=1.31.0")], PRESENT).errors
    assert len(errors) == 1 and "may have huggingface-hub 1.5.0" in errors[0], errors
    assert gpu_wheels.check([wheel("datasets", "5.0.1", "huggingface-hub<2.0,>=0.25.0")], PRESENT).ok


def test_a_pinned_requirement_on_a_package_of_unknown_version_is_an_assumption_not_an_error() -> None:
    report = gpu_wheels.check([wheel("datasets", "5.0.1", "numpy>=1.17")], PRESENT)
    assert report.ok
    assert report.assumptions == [
        "datasets-5.0.1-py3-none-any.whl requires numpy>=1.17; numpy's version there is unknown"
    ]


def test_markers_are_evaluated_for_python_312_on_linux_not_for_the_python_running_the_check() -> None:
    wheels = [
        wheel("a", "1.0", "tomli>=1.1; python_version < '3.11'", "pywin32; sys_platform == 'win32'"),
        wheel("b", "1.0", "missing-on-312; python_version >= '3.12'"),
    ]
    errors = gpu_wheels.check(wheels, PRESENT).errors
    assert errors == ["b-1.0-py3-none-any.whl requires missing-on-312; python_version >= \"3.12\": "
                      "no wheel here and not on the GPU machine"]  # fmt: skip


def test_extras_are_followed_only_when_asked_for() -> None:
    # llm_train's `dev` extra (pytest) is not asked for: no error; fsspec[http] asks for aiohttp: error.
    wheels = [
        wheel("llm_train", "0.1.0", "pytest>=8; extra == 'dev'", "fsspec[http]"),
        wheel("fsspec", "2026.6.0", "aiohttp; extra == 'http'"),
    ]
    errors = gpu_wheels.check(wheels, PRESENT).errors
    assert errors == ["fsspec-2026.6.0-py3-none-any.whl[http] requires aiohttp; extra == \"http\": "
                      "no wheel here and not on the GPU machine"]  # fmt: skip


def test_a_waived_project_is_listed_not_failed() -> None:
    report = gpu_wheels.check([wheel("llm_train", "0.1.0", "wandb>=0.18")], PRESENT, waive=["wandb"])
    assert report.ok and report.waived == [
        "llm_train-0.1.0-py3-none-any.whl requires wandb>=0.18: waived, not shipped"
    ]


def test_a_folder_over_the_budget_fails() -> None:
    big = [wheel("wandb", "0.31.0", size=41 * 2**20)]
    errors = gpu_wheels.check(big, PRESENT, budget_mib=40).errors
    assert errors == ["total 41.0 MiB is over the 40 MiB budget"]


def test_stand_ins_offer_pip_the_lowest_known_version_or_every_version_our_wheels_name() -> None:
    wheels = [wheel("datasets", "5.0.1", "numpy>=1.17,<=2.3.0", "huggingface-hub<2.0,>=0.25.0")]
    versions = gpu_wheels.stand_in_versions(wheels, PRESENT, here={"numpy": "2.4.6"})
    assert versions["huggingface-hub"] == {"1.5.0"}
    assert versions["numpy"] == {"1.17", "2.3.0", "2.4.6"}
    assert versions["torch"] == {"2.11"}


def test_read_wheel_takes_tags_from_the_name_and_requirements_from_metadata(tmp_path: Path) -> None:
    path = tmp_path / "demo_pkg-1.2.3-cp312-cp312-manylinux_2_17_x86_64.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(
            "demo_pkg-1.2.3.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.2.3\nRequires-Python: >=3.10\n"
            "Requires-Dist: numpy>=1.17\nRequires-Dist: pytest; extra == 'dev'\n",
        )
    info = gpu_wheels.read_wheel(path)
    assert (info.name, str(info.version), info.requires_python) == ("demo-pkg", "1.2.3", ">=3.10")
    assert info.requires == ["numpy>=1.17", "pytest; extra == 'dev'"]
    assert {str(t) for t in info.tags} == {"cp312-cp312-manylinux_2_17_x86_64"}
    assert gpu_wheels.check([info], PRESENT).ok


def test_slim_wheel_drops_the_libraries_and_their_record_lines(tmp_path: Path) -> None:
    source = tmp_path / "in" / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    source.parent.mkdir()
    members = {
        "bitsandbytes/__init__.py": b"",
        "bitsandbytes/libbitsandbytes_cpu.so": b"cpu",
        "bitsandbytes/libbitsandbytes_cuda130.so": b"cuda130",
        "bitsandbytes/libbitsandbytes_cuda124.so": b"cuda124" * 1000,
        "bitsandbytes/libbitsandbytes_rocm72.so": b"rocm",
    }
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in members.items())
    with zipfile.ZipFile(source, "w") as whl:
        for name, data in members.items():
            whl.writestr(name, data)
        whl.writestr(
            "bitsandbytes-0.50.2.dist-info/RECORD", record + "bitsandbytes-0.50.2.dist-info/RECORD,,\n"
        )
    target, dropped = slim(source, tmp_path / "out", r"\.so$", r"libbitsandbytes_(cpu|cuda130)\.so$")
    assert target.name == source.name
    assert sorted(dropped) == [
        "bitsandbytes/libbitsandbytes_cuda124.so",
        "bitsandbytes/libbitsandbytes_rocm72.so",
    ]
    with zipfile.ZipFile(target) as whl:
        names = set(whl.namelist())
        kept = whl.read("bitsandbytes-0.50.2.dist-info/RECORD").decode()
    assert "bitsandbytes/libbitsandbytes_cuda130.so" in names and not names & set(dropped)
    assert "cuda124" not in kept and "rocm72" not in kept and "libbitsandbytes_cuda130.so" in kept


def test_liger_travels_and_finds_torch_and_triton_on_the_machine() -> None:
    """memory.liger_kernels on the GPU machine: liger-kernel 0.8.5 is shipped (pure Python), and what it
    requires (its METADATA's lines, extras included) is met by the image's packages file."""
    assert "liger-kernel==0.8.5" in (TOOLS / "build.sh").read_text()
    present = gpu_wheels.read_present((TOOLS / "machine_packages.txt").read_text().splitlines())
    liger = wheel(
        "liger_kernel",
        "0.8.5",
        "torch>=2.1.2",
        "triton>=2.3.1",
        'cuda-tile>=1.5.0; extra == "cutile"',
        'transformers>=5.0.0; extra == "dev"',
    )
    report = gpu_wheels.check([liger], present)
    assert report.ok, report.errors
    # triton's version there is unknown: an assumption, not an error
    assert any("requires triton>=2.3.1" in line for line in report.assumptions)


def test_the_images_libraries_travel_at_the_locks_release_unless_the_image_has_exactly_it() -> None:
    from tools.gpu_wheels.over_image import over_image

    present = gpu_wheels.read_present(
        ["transformers==5.17.0", "safetensors==0.8.0", "peft", "tokenizers>=0.23.1,<0.24"]
    )
    locked = {
        "transformers": "5.24.0",
        "safetensors": "0.8.0",
        "peft": "0.21.2",
        "tokenizers": "0.23.3",
        "wandb": "1",
    }
    names = ["transformers", "safetensors", "peft", "tokenizers", "wandb"]
    # Another release, an unknown one or a range: travels. Exactly the lock's, or not on the image: does not.
    assert over_image(names, present, locked) == [
        "transformers==5.24.0",
        "peft==0.21.2",
        "tokenizers==0.23.3",
    ]
    with pytest.raises(SystemExit, match="not pinned in the lock"):
        over_image(["liger-kernel"], present, locked)


def test_a_result_names_each_library_that_ran_at_another_release_than_the_lock(tmp_path: Path) -> None:
    from bench.environment import not_the_lock

    lock = tmp_path / "lock.txt"
    lock.write_text("transformers==5.24.0\n    # via llm_train\nhuggingface-hub==2.4.0\npeft==0.21.2\n")
    ran = {"torch": "2.11.0+cu130", "transformers": "5.17.0", "huggingface-hub": "2.4.0", "peft": "0.21.2"}
    assert not_the_lock(ran, lock) == {"transformers": "ran 5.17.0, locked 5.24.0"}
    assert not_the_lock(ran, tmp_path / "absent.txt") == {}


def test_missing_names_what_a_wheel_would_fix_and_an_image_package_a_shipped_wheel_breaks() -> None:
    # transformers 5.25 over the image: it needs hub >= 2.4 (the image has 1.x) and kernels (absent).
    shipped = [wheel("transformers", "5.25.0", "huggingface-hub>=2.4.0,<3.0", "kernels>=0.19.1,<0.20")]
    report = gpu_wheels.check(shipped, PRESENT)
    assert report.missing == {"huggingface-hub", "kernels"}
    # With hub 2.4 shipped, the image's tokenizers 0.23.2 (hub < 2.0) is broken: it must travel too.
    image_requires = gpu_wheels.read_image_requires(["tokenizers==0.23.2: huggingface-hub>=0.16.4,<2.0"])
    shipped += [wheel("huggingface_hub", "2.4.0"), wheel("kernels", "0.19.1")]
    report = gpu_wheels.check(shipped, PRESENT, image_requires=image_requires)
    assert report.missing == {"tokenizers"}
    assert any("GPU machine's tokenizers 0.23.2 requires" in e for e in report.errors)
    # Shipped at the lock's release, it shadows the image's copy and its cap no longer applies.
    report = gpu_wheels.check([*shipped, wheel("tokenizers", "0.23.3", "huggingface-hub>=0.16.4,<3.0")],
                              PRESENT, image_requires=image_requires)  # fmt: skip
    assert report.ok and not report.missing


def test_the_image_requires_file_parses_and_names_only_packages_the_image_has() -> None:
    requires = gpu_wheels.read_image_requires((TOOLS / "image_requires.txt").read_text().splitlines())
    present = gpu_wheels.read_present((TOOLS / "machine_packages.txt").read_text().splitlines())
    assert "tokenizers" in requires and requires["tokenizers"][1] == ["huggingface-hub>=0.16.4,<2.0"]
    for name, (version, _) in requires.items():
        assert name in present and present[name].contains(version), name
