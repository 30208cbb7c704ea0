"""The repository explains itself: nothing in it points at a file a reader of it does not have.

Notes kept outside the repository (a design file, a shared folder, its numbered "facts") are not
part of what users and contributors get. A fact the code relies on is stated where it is used, in
the comment or docstring, with what was checked and how. A file may number its own facts and refer
to them ("fact 2" next to a list item "2. ..." of the same file).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The outside names are spelled in pieces here, so that this file does not itself point at them.
# The notes file's name in capitals (as "<NAME>.md", "<NAME> fact 7", "<NAME>: ..."), and the
# shared folder beside the checkout.
NOTES = "DES" + "IGN"
SHARED = "shar" + "ed"
OUTSIDE = re.compile(rf"\b{NOTES}\b|(?i:\b{NOTES.lower()} facts?\b|\.\./{SHARED}\b|/work/{SHARED}\b)")
FACT = re.compile(r"\bfacts? (\d+)", re.IGNORECASE)
THIS = Path(__file__).resolve()


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    paths = [REPO / name for name in listed.split("\0") if name]
    return [p for p in paths if p.is_file() and p.resolve() != THIS and b"\0" not in p.read_bytes()[:8192]]


def references_outside(text: str) -> list[str]:
    """The phrases of `text` that point outside the repository."""
    found = [m.group(0) for m in OUTSIDE.finditer(text)]
    own = {m.group(1) for m in re.finditer(r"^\s*(\d+)\. ", text, re.MULTILINE)}  # its own numbered list
    found += [m.group(0) for m in FACT.finditer(text) if m.group(1) not in own]
    return found


def test_no_file_refers_to_notes_outside_the_repository() -> None:
    files = tracked_text_files()
    assert len(files) > 100  # the listing found the repository
    offenders = {
        str(path.relative_to(REPO)): refs
        for path in files
        if (refs := references_outside(path.read_text(errors="replace")))
    }
    assert offenders == {}


def test_the_check_sees_each_kind_of_reference() -> None:
    assert references_outside(f"as {NOTES}.md says") == [NOTES]
    assert references_outside(f"{NOTES}: 16 bytes per parameter") == [NOTES]
    assert references_outside(f"see ../{SHARED}/tools") == [f"../{SHARED}"]
    assert references_outside("(fact 13)") == ["fact 13"]
    assert references_outside(f"{NOTES.title()} facts: H100 989") == [f"{NOTES.title()} facts"]
    # A file's own numbered facts may be cited in it.
    assert references_outside("Facts:\n\n1. Pinned buffers round up.\n\nx = 1  # (fact 1)\n") == []
    assert references_outside("1. One.\n(fact 2)") == ["fact 2"]
