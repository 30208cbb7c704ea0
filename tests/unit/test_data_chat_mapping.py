"""Chat sources in other shapes: field and role mappings, the ShareGPT preset, tool messages, one-line refusals.

The rule: a conversation mapped from another shape tokenises exactly as the same conversation written
OpenAI-style (same ids, same loss mask), so it trains on the assistant turns only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llm_train.config.source_schema import ChatSource
from llm_train.data import prepare_data
from llm_train.data.summary import mapped_conversations
from llm_train.errors import UserError
from tests.unit.data_fixtures import CHAT_JSONL, data_section, get_tokenizer, write_jsonl

SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}


def sharegpt(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style rows as ShareGPT writes them: conversations[].from/value, human/gpt/system."""
    return [
        {"conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in r["messages"]]}
        for r in rows
    ]


def _store(
    tmp_path: Path, source: dict[str, Any], name: str, **data: Any
) -> tuple[list[list[int]], list[list[int]]]:
    """Every row's (ids, loss mask) as tokenised, in row order."""
    section = data_section(tmp_path / name, train=[source], seq_len=512, **data)
    store = prepare_data(section, get_tokenizer(), seed=0).train.parts[0].store
    rows = [
        store.tokens(int(store.offsets[i]), int(store.offsets[i + 1] - store.offsets[i]))
        for i in range(store.rows)
    ]
    return [ids.tolist() for ids, _ in rows], [mask.tolist() for _, mask in rows]


def _fails(tmp_path: Path, source: dict[str, Any], **data: Any) -> str:
    with pytest.raises(UserError) as info:
        _store(tmp_path, source, "fail", **data)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_sharegpt_file_with_the_preset_tokenises_as_its_openai_original(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in CHAT_JSONL.read_text().splitlines()[:12]]
    original = write_jsonl(tmp_path / "openai.jsonl", rows)
    shared = write_jsonl(tmp_path / "sharegpt.jsonl", sharegpt(rows))
    want = _store(tmp_path, {"path": str(original), "format": "chat"}, "a")
    got = _store(tmp_path, {"path": str(shared), "format": "chat", "preset": "sharegpt"}, "b")
    assert got == want
    # ...and what it trains on is the assistant turns, each with its end-of-turn token, nothing else.
    tok = get_tokenizer()
    for (ids, mask), row in zip(zip(*got, strict=True), rows, strict=True):
        trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        assert trained == "".join(
            m["content"] + "<|eos|>" for m in row["messages"] if m["role"] == "assistant"
        )


def test_any_field_names_and_role_values_map(tmp_path: Path) -> None:
    rows = [json.loads(CHAT_JSONL.read_text().splitlines()[0])]
    names = {"system": "instructions", "user": "person", "assistant": "bot"}
    custom = [
        {"dialog": [{"speaker": names[m["role"]], "text": m["content"]} for m in r["messages"]]} for r in rows
    ]
    source = {
        "path": str(write_jsonl(tmp_path / "custom.jsonl", custom)),
        "format": "chat",
        "messages_field": "dialog",
        "role_field": "speaker",
        "content_field": "text",
        "roles": {"instructions": "system", "person": "user", "bot": "assistant"},
    }
    original = {"path": str(write_jsonl(tmp_path / "openai.jsonl", rows)), "format": "chat"}
    assert _store(tmp_path, source, "a") == _store(tmp_path, original, "b")


def test_a_system_column_goes_first(tmp_path: Path) -> None:
    row = {
        "system": "Be brief.",
        "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}],
    }
    as_messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    as_messages.append({"role": "assistant", "content": "Hello"})
    got = _store(
        tmp_path,
        {"path": str(write_jsonl(tmp_path / "s.jsonl", [row])), "format": "chat", "preset": "sharegpt"},
        "a",
    )
    want = _store(
        tmp_path,
        {"path": str(write_jsonl(tmp_path / "o.jsonl", [{"messages": as_messages}])), "format": "chat"},
        "b",
    )
    assert got == want


def test_an_unknown_role_is_one_line_naming_the_row_the_field_and_the_mapping(tmp_path: Path) -> None:
    rows = sharegpt([json.loads(CHAT_JSONL.read_text().splitlines()[0])])
    rows.append({"conversations": [{"from": "human", "value": "Hi"}, {"from": "chatgpt", "value": "Hello"}]})
    source = {"path": str(write_jsonl(tmp_path / "s.jsonl", rows)), "format": "chat", "preset": "sharegpt"}
    message = _fails(tmp_path, source)
    assert "row 2: message 1: role 'chatgpt' (field 'from')" in message
    assert "roles: {chatgpt: assistant}" in message, message


def test_sharegpt_rows_without_the_preset_say_which_key_to_set(tmp_path: Path) -> None:
    rows = sharegpt([json.loads(CHAT_JSONL.read_text().splitlines()[0])])
    path = str(write_jsonl(tmp_path / "s.jsonl", rows))
    # The column: the user got "message 0 needs 'role' and 'content'" with nothing to set.
    message = _fails(tmp_path, {"path": path, "format": "chat"})
    assert "no field 'messages'" in message and "set preset: sharegpt" in message
    renamed = [{"messages": r["conversations"]} for r in rows]
    message = _fails(tmp_path, {"path": str(write_jsonl(tmp_path / "r.jsonl", renamed)), "format": "chat"})
    assert "row 1: message 0 has no 'role' (has: from, value); set preset: sharegpt" in message


def test_a_role_mapped_to_nothing_templates_know_is_refused_when_the_recipe_loads() -> None:
    with pytest.raises(ValueError, match="roles.bot: 'robot' is not a role chat templates know"):
        ChatSource.model_validate({"path": "x.jsonl", "roles": {"bot": "robot"}})
    # The preset's roles stay, the source's own come on top (and win).
    source = ChatSource.model_validate({"path": "x.jsonl", "preset": "sharegpt", "roles": {"gpt": "user"}})
    assert source.roles["human"] == "user" and source.roles["gpt"] == "user"
    assert (source.messages_field, source.role_field, source.content_field) == (
        "conversations",
        "from",
        "value",
    )


TOOL_TEMPLATE = (
    "{{- '<|bos|>' -}}{%- for message in messages -%}{{- '<|' + message['role'] + '|>\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}{%- generation -%}"
    "{%- if message.get('tool_calls') -%}{%- for call in message['tool_calls'] -%}"
    "{{- 'CALL ' + call['function']['name'] + ' ' + (call['function']['arguments'] | tojson) -}}"
    "{%- endfor -%}{%- else -%}{{- message['content'] -}}{%- endif -%}{{- '<|eos|>' -}}{%- endgeneration -%}"
    "{%- else -%}{{- message['content'] + '<|eos|>' -}}{%- endif -%}{%- endfor -%}"
)
TOOL_ROWS = [
    {
        "conversations": [
            {"from": "human", "value": "Weather in Oslo?"},
            {
                "from": "function_call",
                "value": json.dumps({"name": "weather", "arguments": {"city": "Oslo"}}),
            },
            {"from": "observation", "value": "rain"},
            {"from": "gpt", "value": "It rains."},
        ]
    }
]


def test_tool_calls_and_results_reach_a_template_that_renders_them(tmp_path: Path) -> None:
    source = {
        "path": str(write_jsonl(tmp_path / "t.jsonl", TOOL_ROWS)),
        "format": "chat",
        "preset": "sharegpt",
    }
    ids, mask = (x[0] for x in _store(tmp_path, source, "a", chat_template=TOOL_TEMPLATE))
    tok = get_tokenizer()
    text = tok.decode(ids)
    assert "<|tool|>\nrain<|eos|>" in text  # the observation, as the template's tool turn
    # The model is trained on its call and its answer; the tool's result is context.
    trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == 'CALL weather {"city": "Oslo"}<|eos|>It rains.<|eos|>'
    # OpenAI's own shape (role tool, tool_calls) passes through unchanged and tokenises the same.
    openai = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
            ],
        },
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "It rains."},
    ]
    path = write_jsonl(tmp_path / "o.jsonl", [{"messages": openai}])
    assert _store(tmp_path, {"path": str(path), "format": "chat"}, "b", chat_template=TOOL_TEMPLATE) == (
        [ids],
        [mask],
    )


def test_tool_messages_under_a_template_without_tools_are_one_line(tmp_path: Path) -> None:
    source = {
        "path": str(write_jsonl(tmp_path / "t.jsonl", TOOL_ROWS)),
        "format": "chat",
        "preset": "sharegpt",
    }
    message = _fails(tmp_path, source)  # the bundled template knows system, user and assistant only
    assert "row 1: the conversation has tool messages" in message and "data.chat_template" in message
    bad = [
        {
            "conversations": [
                {"from": "human", "value": "x"},
                {"from": "function_call", "value": "weather(Oslo)"},
            ]
        }
    ]
    source = {"path": str(write_jsonl(tmp_path / "b.jsonl", bad)), "format": "chat", "preset": "sharegpt"}
    message = _fails(tmp_path, source, chat_template=TOOL_TEMPLATE)
    assert "row 1: message 1 is a tool call (role tool_call) but its text is not JSON" in message


def test_inspect_shows_the_mapping_and_the_mapped_conversation(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", TOOL_ROWS)
    section = data_section(tmp_path, train=[{"path": str(path), "format": "chat", "preset": "sharegpt"}])
    lines = mapped_conversations(section)
    assert "conversations[].from -> role, .value -> content" in lines[0] and "gpt->assistant" in lines[0]
    assert lines[2:] == [
        "    [user] Weather in Oslo?",
        "    [assistant] weather({'city': 'Oslo'})",
        "    [tool] rain",
        "    [assistant] It rains.",
    ]
