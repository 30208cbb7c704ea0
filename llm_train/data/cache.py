"""A directory per cache entry, built once under a file lock and published by an atomic rename.

Every rank of a node calls `cached(...)` with the same key: the first builds, the others
wait on the lock and then read what it wrote. A crash mid-build leaves only a temporary
folder, never a half-written entry.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

META = "meta.json"


def cached(entry: Path, build: Callable[[Path], dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """(meta, status): the entry's meta.json, building it first when missing.

    status: "hit" (it was there), "miss" (built now, here) or "waited" (built meanwhile by another
    process, typically another rank of this node).
    """
    from filelock import FileLock

    if (entry / META).is_file():
        return _read(entry), "hit"
    entry.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(entry) + ".lock"):
        if (entry / META).is_file():  # another process built it while we waited
            return _read(entry), "waited"
        tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            meta = build(tmp)
            (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
            shutil.rmtree(entry, ignore_errors=True)  # a folder without meta.json is debris
            os.replace(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return meta, "miss"


def _read(entry: Path) -> dict[str, Any]:
    return json.loads((entry / META).read_text())
