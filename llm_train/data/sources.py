"""Find a source and load it as a memory-mapped Hugging Face `datasets.Dataset`.

A source path is, in this order: a glob; an existing file; an existing folder (written by
`save_to_disk`, or holding data files); something that looks like a local path but does
not exist (an error, never a silent hub lookup); otherwise a hub dataset id. Rows stay in
Arrow files on disk: nothing here reads a corpus into Python lists.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from llm_train.data.fingerprint import files_signature
from llm_train.errors import UserError, first_line

if TYPE_CHECKING:
    from datasets import Dataset

    from llm_train.config.source_schema import Source

# Suffix -> the `datasets` packaged builder that reads it.
BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
}
_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Located:
    """Where a source's rows are: local data files, a save_to_disk folder, or a hub id."""

    kind: Literal["files", "disk", "hub"]
    path: str
    files: tuple[Path, ...] = ()
    builder: str | None = None

    def signature(self) -> str | None:
        """Content signature for the cache key; None for hub ids (the loaded dataset's fingerprint is used)."""
        return files_signature(self.files) if self.files else None

    def describe(self) -> str:
        if self.kind == "files" and len(self.files) == 1:
            return str(self.files[0])
        if self.kind == "files":
            return f"{self.path} ({len(self.files)} files)"
        return self.path


def locate(path: str, key: str) -> Located:
    expanded = str(Path(path).expanduser())
    if any(ch in path for ch in "*?["):
        matches = sorted(Path(m) for m in glob.glob(expanded, recursive=True) if Path(m).is_file())
        if not matches:
            raise UserError(f"{key}: no files match '{path}'")
        return Located("files", path, tuple(matches), _builder_of(matches, key))
    local = Path(expanded)
    if local.is_file():
        return Located("files", path, (local,), _builder_of([local], key))
    if local.is_dir():
        if any((local / marker).is_file() for marker in _DISK_MARKERS):
            return Located("disk", path, tuple(p for p in sorted(local.rglob("*")) if p.is_file()))
        files = sorted(p for p in local.rglob("*") if p.is_file() and p.suffix in BUILDERS)
        if not files:
            raise UserError(
                f"{key}: folder {path} holds no data files ({', '.join(BUILDERS)}) and was not written by "
                "datasets' save_to_disk"
            )
        return Located("files", path, tuple(files), _builder_of(files, key))
    if _looks_local(path):
        raise UserError(f"{key}: file not found: {path}")
    return Located("hub", path)


def check_revision(located: Located, source: Source, key: str) -> None:
    """`revision` names a commit of a hub dataset; on a local source it would be silently meaningless."""
    if getattr(source, "revision", None) is not None and located.kind != "hub":
        raise UserError(
            f"{key}.revision: {located.describe()} is a local source; revision applies to hub datasets only "
            "(remove it, or name the hub dataset's id as the path)"
        )


def _looks_local(path: str) -> bool:
    return path.startswith((".", "/", "~")) or Path(path).suffix in BUILDERS


def _builder_of(files: list[Path], key: str) -> str:
    builders = set()
    for file in files:
        if file.suffix not in BUILDERS:
            raise UserError(
                f"{key}: {file}: unsupported file type '{file.suffix}'; use one of {', '.join(BUILDERS)}"
            )
        builders.add(BUILDERS[file.suffix])
    if len(builders) > 1:
        raise UserError(
            f"{key}: mixes file types ({', '.join(sorted(builders))}); give each type its own source"
        )
    return builders.pop()


def load_rows(located: Located, source: Source, key: str, cache_dir: Path) -> Dataset:
    """The source's rows as a `datasets.Dataset` (Arrow, memory-mapped)."""
    import datasets

    datasets.disable_progress_bars()  # the caller prints one line per source instead
    hf_cache = str(cache_dir / "hf")
    if located.kind == "disk":
        loaded = datasets.load_from_disk(located.path)
        if isinstance(loaded, datasets.DatasetDict):
            if source.split not in loaded:
                raise UserError(
                    f"{key}: {located.path} has no split '{source.split}' (splits: {', '.join(loaded)}); set split"
                )
            loaded = loaded[source.split]
        return _non_empty(loaded, located, key)
    if located.kind == "hub":
        try:
            loaded = datasets.load_dataset(
                located.path,
                name=source.subset,
                split=source.split,
                revision=getattr(source, "revision", None),
                cache_dir=hf_cache,
            )
        except Exception as exc:  # offline, unknown id, unknown split: one line, the library's own words
            raise UserError(
                f"{key}: cannot load '{located.path}' as a local path or a hub dataset ({first_line(exc)})"
            ) from None
        return _non_empty(loaded, located, key)

    for file in located.files:
        if file.stat().st_size == 0:
            raise UserError(f"{key}: {file} is empty")
    options: dict[str, Any] = {}
    if located.builder == "text":
        options["sample_by"] = getattr(source, "sample_by", "paragraph")
    try:
        loaded = datasets.load_dataset(
            located.builder,
            data_files=[str(f) for f in located.files],
            split="train",
            cache_dir=hf_cache,
            **options,
        )
    except Exception as exc:
        if located.builder == "json":
            for file in located.files:
                find_bad_json(file)  # raises with file and line number
        raise UserError(f"{key}: cannot read {located.describe()} ({first_line(exc)})") from None
    return _non_empty(loaded, located, key)


def _non_empty(rows: Dataset, located: Located, key: str) -> Dataset:
    if len(rows) == 0:
        raise UserError(f"{key}: {located.describe()} has no rows")
    return rows


def find_bad_json(path: Path) -> None:
    """Raise a UserError naming the first line of `path` that is not a JSON object (JSON Lines or one JSON array)."""
    with path.open(encoding="utf-8", errors="replace") as handle:
        first = handle.read(1 << 16).lstrip()
    if path.suffix == ".json" and first.startswith("["):
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        return
    with path.open(encoding="utf-8", errors="replace") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
