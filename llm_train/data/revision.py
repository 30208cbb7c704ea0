"""Which commit of a hub dataset a run reads, so that a resume reads the same one.

A hub dataset can change between a save and a resume. For a streamed source the checkpoint holds
offsets into the stream (datasets' shard and row position): read against another revision they
silently point at other rows. So each hub source is read at one commit sha, recorded in the
checkpoint's data state, and a resume whose sources resolve to other commits is refused in one
line (data/stream_windows.py) unless the user says so (--allow-data-revision-change).

The sha: a source's `revision:` when it already is one (40 hex digits: nothing to look up);
else the hub's answer for the branch or tag (`HfApi.dataset_info`, the default branch without a
revision); offline, the ref the local hub cache recorded when the dataset was downloaded
(HF_HUB_CACHE/datasets--ORG--NAME/refs/REF, huggingface_hub's cache layout). None when none of
these answers: the run then reads what `datasets` gives and records no revision.
"""

from __future__ import annotations

import re
from pathlib import Path

SHA = re.compile(r"[0-9a-f]{40}")


def resolve_revision(repo_id: str, revision: str | None) -> str | None:
    """The commit sha `revision` of hub dataset `repo_id` names now (None: unknown)."""
    if revision is not None and SHA.fullmatch(revision):
        return revision
    found = hub_sha(repo_id, revision)
    return found if found is not None else cached_sha(repo_id, revision)


def hub_sha(repo_id: str, revision: str | None) -> str | None:
    """The hub's commit for the ref (the default branch for None); None offline or on any hub error."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        return HfApi().dataset_info(repo_id, revision=revision).sha
    except Exception:  # unreachable, unknown id or ref: the loader reports those in its own words
        return None


def cached_sha(repo_id: str, revision: str | None) -> str | None:
    """The commit the local hub cache recorded for the ref, when the dataset was downloaded."""
    from huggingface_hub import constants

    ref = (
        Path(constants.HF_HUB_CACHE)
        / f"datasets--{repo_id.replace('/', '--')}"
        / "refs"
        / (revision or "main")
    )
    try:
        sha = ref.read_text().strip()
    except OSError:
        return None
    return sha if SHA.fullmatch(sha) else None
