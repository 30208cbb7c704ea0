"""Hub datasets are read at one commit, recorded in checkpoints; a resume that would read another is refused.

There is no hub here, so the hub is stood in for at its two seams: `revision.hub_sha` (what
`HfApi.dataset_info(...).sha` answers) and `datasets.load_dataset` for the hub id, which reads a
local JSON Lines file with the same arguments (streaming or not) and records the revision it was
asked for. Everything between those seams, where llm_train decides which commit to read, what to
record and what to refuse, is the product's real code path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llm_train.data import prepare_data
from llm_train.data.revision import resolve_revision
from llm_train.data.stream_windows import StreamingBatches, StreamSpec
from llm_train.errors import UserError
from tests.unit.data_fixtures import data_section, get_tokenizer, samples_of, text_rows, write_jsonl

HUB_ID = "some-org/some-corpus"
SHA_A, SHA_B = "a" * 40, "b" * 40


class FakeHub:
    """The hub's answer for HUB_ID (a commit that can move) and the load_dataset calls made for it."""

    def __init__(self, corpus: Path) -> None:
        self.corpus, self.sha, self.loads, self.lookups = corpus, SHA_A, [], 0

    def hub_sha(self, repo_id: str, revision: str | None) -> str | None:
        assert repo_id == HUB_ID
        self.lookups += 1
        return self.sha

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
        import datasets

        import llm_train.data.revision as revision

        real = datasets.load_dataset

        def load_dataset(path: str, *args: Any, **kwargs: Any) -> Any:
            if path != HUB_ID:
                return real(path, *args, **kwargs)
            self.loads.append(
                {"revision": kwargs.get("revision"), "streaming": kwargs.get("streaming", False)}
            )
            return real(
                "json",
                data_files=[str(self.corpus)],
                split="train",
                streaming=kwargs.get("streaming", False),
                cache_dir=kwargs.get("cache_dir"),
            )

        monkeypatch.setattr(datasets, "load_dataset", load_dataset)
        monkeypatch.setattr(revision, "hub_sha", self.hub_sha)
        return self


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    return FakeHub(write_jsonl(tmp_path / "corpus.jsonl", text_rows(60))).install(monkeypatch)


def _spec(tmp_path: Path, **source: Any) -> StreamSpec:
    train = [{"path": HUB_ID, "streaming": True, **source}]
    return StreamSpec.build(
        data_section(tmp_path, train=train, seq_len=48), get_tokenizer(), 7, window_rows=16
    )


def _stream(spec: StreamSpec) -> StreamingBatches:
    return StreamingBatches(spec, 2, 0, 1, workers=0)


def test_a_streamed_hub_source_is_read_at_its_resolved_commit_and_the_commit_is_saved(
    tmp_path: Path, hub: FakeHub
) -> None:
    spec = _spec(tmp_path)
    assert spec.revisions == [SHA_A]
    stream = _stream(spec)
    first = samples_of(next(stream))
    assert hub.loads == [{"revision": SHA_A, "streaming": True}]  # the commit, not "main"
    assert stream.state_dict()["data_revisions"] == [SHA_A]
    # The same rows as the file itself, streamed as a local source.
    local = StreamSpec.build(
        data_section(tmp_path, train=[{"path": str(hub.corpus), "streaming": True}], seq_len=48),
        get_tokenizer(),
        7,
        window_rows=16,
    )
    assert samples_of(next(_stream(local))) == first


def test_a_resume_after_the_hub_moved_is_refused_in_one_line_unless_allowed(
    tmp_path: Path, hub: FakeHub
) -> None:
    saved = _stream(_spec(tmp_path))
    next(saved)
    state = saved.state_dict()
    hub.sha = SHA_B  # the dataset changed on the hub between save and resume
    resumed = _stream(_spec(tmp_path))
    with pytest.raises(UserError) as caught:
        resumed.load_state_dict(state)
    message = str(caught.value)
    assert "\n" not in message and f"data.train[0] ({HUB_ID})" in message
    assert f"read dataset revision {SHA_A}, the hub now gives {SHA_B}" in message
    assert f"data.train[0].revision={SHA_A}" in message and "--allow-data-revision-change" in message
    notices = resumed.check_state(state, allow_revision_change=True)
    assert notices == [
        f"data.train[0] ({HUB_ID}): dataset revision {SHA_A} -> {SHA_B} (--allow-data-revision-change)"
    ]
    resumed.load_state_dict(state, allow_revision_change=True)
    assert resumed.consumed == state["sequences_consumed"]


def test_pinning_the_checkpoints_commit_resumes_without_asking_the_hub(tmp_path: Path, hub: FakeHub) -> None:
    saved = _stream(_spec(tmp_path))
    expected = [samples_of(next(saved)) for _ in range(3)]
    state = _stream(_spec(tmp_path)).state_dict()
    hub.sha, lookups = SHA_B, hub.lookups
    pinned = _stream(_spec(tmp_path, revision=SHA_A))
    assert hub.lookups == lookups  # a commit sha is not looked up
    pinned.load_state_dict(state)  # same fingerprint: the pin is compared as a revision, not as data
    assert [samples_of(next(pinned)) for _ in range(3)] == expected
    assert hub.loads[-1]["revision"] == SHA_A


def test_a_branch_is_resolved_and_a_checkpoint_without_revisions_resumes_with_a_notice(
    tmp_path: Path, hub: FakeHub
) -> None:
    spec = _spec(tmp_path, revision="v2")
    assert spec.revisions == [SHA_A] and hub.lookups == 1
    state = {k: v for k, v in _stream(spec).state_dict().items() if k != "data_revisions"}  # older llm_train
    notices = _stream(spec).check_state(state)
    assert len(notices) == 1 and "cannot be compared" in notices[0] and "data.train[0].revision" in notices[0]


def test_offline_the_local_hub_cache_names_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    refs = tmp_path / f"datasets--{HUB_ID.replace('/', '--')}" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text(SHA_A + "\n")
    (refs / "v2").write_text(SHA_B)
    assert resolve_revision(HUB_ID, None) == SHA_A
    assert resolve_revision(HUB_ID, "v2") == SHA_B
    assert resolve_revision(HUB_ID, "v3") is None  # never downloaded: unknown, not guessed
    assert resolve_revision("other/corpus", None) is None


def test_a_tokenised_hub_source_is_loaded_at_its_pinned_revision(tmp_path: Path, hub: FakeHub) -> None:
    def tokens(**source: Any) -> list[int]:
        data = data_section(tmp_path / str(len(hub.loads)), train=[source], seq_len=64)
        store = prepare_data(data, get_tokenizer(), seed=0).train.parts[0].store
        return store.input_ids[: int(store.offsets[-1])].tolist()

    from_hub = tokens(path=HUB_ID, revision="v1")
    assert hub.loads == [{"revision": "v1", "streaming": False}]
    assert from_hub == tokens(path=str(hub.corpus))  # the hub path reads the rows a local file gives


def test_a_revision_on_a_local_source_is_one_line(tmp_path: Path, hub: FakeHub) -> None:
    with pytest.raises(UserError, match=r"data.train\[0\].revision: .* is a local source; revision applies"):
        StreamSpec.build(
            data_section(tmp_path, train=[{"path": str(hub.corpus), "streaming": True, "revision": "v1"}]),
            get_tokenizer(),
            7,
        )
