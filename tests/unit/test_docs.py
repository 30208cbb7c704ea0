"""The README and docs/ say what the repository does: links resolve, the tables match the files.

The README is the front door: the set-up commands CI runs, the first run on a GPU, one row per
shipped recipe with the planner's verdict, a page index that lists every page of docs/, and six
files to read first; docs/development.md maps every package (paths that exist) and every module. Every relative link in the Markdown files, anchors included,
lands on a file and a heading that exist.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from llm_train.config.recipe import load_recipe
from llm_train.planning.report.verdict import plan_recipe
from tests.helpers import REPO

README = REPO / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
VERDICT = re.compile(r"FITS BUT IMPRACTICAL|DOES NOT FIT|FITS")


def markdown_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "*.md"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [REPO / name for name in listed.split("\0") if name and (REPO / name).is_file()]


def without_code(text: str) -> str:
    """The prose of a Markdown text: fenced blocks, indented blocks and code spans removed."""
    text = FENCE.sub("", text)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    return CODE_SPAN.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            name, n = base, 0
            while name in found:  # GitHub numbers repeated headings: x, x-1, x-2
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(without_code(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not a file of this repository
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with that anchor)")
    return broken


def section(text: str, heading: str) -> str:
    """The text under a `## heading` of the README, up to the next `## `."""
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of every Markdown table in text, as stripped cells (each header and rule dropped)."""
    rows: list[list[str]] = []
    for table in re.findall(r"(?:^\|.*\n?)+", text, re.MULTILINE):
        lines = table.splitlines()
        assert set(lines[1]) <= set("|-: "), f"a table without a header rule: {lines[0]}"
        rows += [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines[2:]]
    return rows


# --- links ------------------------------------------------------------------------------------------------


def test_every_relative_link_resolves() -> None:
    files = markdown_files()
    assert README in files and len(files) >= 10  # the listing found README.md and docs/
    assert {str(p.relative_to(REPO)): b for p in files if (b := broken_links(p))} == {}


def test_the_link_check_catches_each_kind_of_break(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A section (`x.py`)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md) [ok](other.md#a-section-xpy) [ok](#page) [web](https://x.org/y)\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [bad here](#nope)\n"
        "`[in code](missing.md)`\n\n```\n[in a fence](missing.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.md (no such file)",
        "other.md#nope (no heading with that anchor)",
        "#nope (no heading with that anchor)",
    ]
    assert slug("Attention kernels (`memory.attention`, `llm_train/config/attention_kernel.py`)") == (
        "attention-kernels-memoryattention-llm_trainconfigattention_kernelpy"
    )


# --- the README's contents --------------------------------------------------------------------------------


def test_the_set_up_is_the_two_make_commands_ci_runs() -> None:
    block = section(README.read_text(), "Set up (fresh machine: two commands)").split("```bash\n", 1)[1]
    commands = [line.split("#", 1)[0].strip() for line in block.split("```", 1)[0].splitlines()]
    assert commands == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.MULTILINE) and re.search(r"^test:", makefile, re.MULTILINE)
    assert "make test" in (REPO / ".ci" / "run").read_text().splitlines()  # CI runs the README's command


def recipe_rows() -> dict[str, list[str]]:
    rows = table_rows(section(README.read_text(), "Recipes"))
    names = [row[0].strip("`") for row in rows]
    assert len(names) == len(set(names)), "a recipe has two rows"
    return dict(zip(names, rows, strict=True))


def test_the_recipes_table_has_one_row_per_shipped_recipe() -> None:
    assert sorted(recipe_rows()) == sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "recipes").glob("*.yaml")))
def test_each_recipe_row_states_its_deepspeed_config_and_the_planners_verdict(name: str) -> None:
    _, _, deepspeed, _, verdict = recipe_rows()[name]
    assert deepspeed.split()[0] == load_recipe(name).deepspeed.config
    stated = VERDICT.search(verdict)
    assert stated, verdict
    nvme = re.search(r"--nvme-gib (\d+)", verdict)  # NVMe offload fits only with the drive's size given
    # "with flash-attn": the verdict of memory.attention=auto where flash-attn is installed, on any machine.
    flash = ["memory.attention=flash_attention_2"] if "with flash-attn" in verdict else []
    report = plan_recipe(name, flash, detect=False, nvme_gib=float(nvme.group(1)) if nvme else None)
    assert report.word == stated.group(0)


def test_the_page_index_lists_every_docs_page() -> None:
    index = section(README.read_text(), "Documentation (`docs/`)")
    listed = set(re.findall(r"\]\(docs/([^)#]+\.md)\)", index))
    assert listed == {p.name for p in (REPO / "docs").glob("*.md")}


def test_the_code_map_covers_every_package_and_names_files_that_exist() -> None:
    rows = table_rows(section((REPO / "docs" / "development.md").read_text(), "Map of the code"))
    mapped = {row[0].strip("`").rstrip("/"): row[1] for row in rows}
    package = REPO / "llm_train"
    expected = {
        f"llm_train/{p.name}"
        for p in package.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()
    } | {"bench", "docs", "ds_configs", "launch", "recipes", "tests", "tools"}
    assert set(mapped) == expected
    for where, answer in mapped.items():
        folder = REPO / where
        assert folder.exists(), where
        for name in re.findall(r"`([\w/]+\.py)`", answer):
            assert (folder / name).is_file() if folder.is_dir() else name == folder.name, f"{where}: {name}"


def test_the_readme_tours_seven_files_that_exist() -> None:
    rows = table_rows(section(README.read_text(), "Where to start reading"))
    files = [row[0].strip("`") for row in rows]
    assert len(files) == len(set(files)) == 7
    assert "llm_train/runtime/loss/__init__.py" in files  # "where is the loss" has one answer
    assert all((REPO / f).is_file() for f in files), files


def test_the_readme_shows_the_first_run_on_a_card() -> None:
    """doctor, then plan, then the launch with the user's data: in that order, in one block."""
    block = section(README.read_text(), "First run on your card").split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]
    assert len(commands) <= 5
    order = [
        next(i for i, c in enumerate(commands) if c.startswith(start))
        for start in ("llm-train doctor", "llm-train plan --recipe", "accelerate launch llm_train/train.py")
    ]
    assert order == sorted(order) and "'data.train=[my.jsonl]'" in commands[order[-1]]
    recipe = commands[order[1]].split("--recipe ", 1)[1].split()[0]
    assert f"--recipe {recipe} " in commands[order[2]] and (REPO / "recipes" / f"{recipe}.yaml").is_file()


def test_the_module_map_lists_every_module_once() -> None:
    page = (REPO / "docs" / "development.md").read_text()
    listed = sorted(row[0].strip("`") for row in table_rows(section(page, "Every module")))
    package = REPO / "llm_train"
    modules = sorted(str(p.relative_to(package)) for p in package.rglob("*.py") if p.name != "__init__.py")
    assert listed == modules, "docs/development.md's 'Every module' needs one line per module of llm_train/"
