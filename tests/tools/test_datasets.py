"""Prompt-set readers: the bundled development sets (tandem/tools/prompts) and small files of every format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.tools.datasets import (
    CODE_INSTRUCTION,
    DEV_SETS,
    PROMPTS_DIR,
    PromptRecord,
    bfcl_schema,
    load_prompts,
    resolve_dataset,
    to_chat,
)

def _data_file(name: str) -> Path:
    """A bundled prompt set: it ships with the package, so it is always here."""
    return PROMPTS_DIR / name


def _write(tmp_path: Path, name: str, lines: list) -> Path:
    path = tmp_path / name
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    return path


# --- the real files -------------------------------------------------------------------------------


def test_mt_bench_file() -> None:
    records = load_prompts(_data_file("mt_bench_question.jsonl"))
    assert len(records) == 80
    first = records[0]
    assert first.id == "81" and first.dataset == "mt_bench_question" and first.category == "writing"
    assert len(first.turns) == 2 and first.turns[0].startswith("Compose an engaging travel blog post")
    assert first.system is None and first.messages is None
    assert all(len(r.turns) == 2 for r in records)
    assert len({r.category for r in records}) == 8
    assert to_chat(first) == [{"role": "user", "content": first.turns[0]}]


def test_gsm8k_file_with_limit() -> None:
    records = load_prompts(_data_file("gsm8k_question.jsonl"), limit=5)
    assert [r.id for r in records] == ["0", "1", "2", "3", "4"]
    assert all(r.category == "math" and len(r.turns) == 1 for r in records)
    assert records[0].turns[0].startswith("Darrell and Allen's ages")


def test_humaneval_file_asks_the_chat_model_for_code() -> None:
    records = load_prompts(_data_file("HumanEval.jsonl"))
    assert len(records) == 164
    first = records[0]
    assert first.id == "HumanEval/0" and first.dataset == "HumanEval" and first.category is None
    raw = json.loads(_data_file("HumanEval.jsonl").open().readline())["prompt"]
    assert first.turns == [CODE_INSTRUCTION.format(prompt=raw)]
    assert first.turns[0].startswith("Complete the following Python function.")
    assert "```python\n" + raw + "```" in first.turns[0]


@pytest.mark.parametrize("name,count", [("BFCL_v4_simple_python", 400), ("BFCL_v4_multiple", 200)])
def test_bfcl_files_put_json_schema_tools_in_the_system_prompt(name: str, count: int) -> None:
    path = _data_file(f"bfcl/{name}.json")
    records = load_prompts(path)
    assert len(records) == count and records[0].dataset == name
    raw = [json.loads(line) for line in path.open()]
    for rec, obj in zip(records, raw):
        assert rec.id == obj["id"]
        assert rec.messages == obj["question"][0]
        assert rec.turns == [m["content"] for m in obj["question"][0] if m["role"] == "user"]
        assert '"type": "dict"' not in rec.system and '"type": "float"' not in rec.system
        for f in obj["function"]:
            assert json.dumps(bfcl_schema(f), ensure_ascii=False) in rec.system
    first = records[0]
    assert "JSON object" in first.system and '"type": "object"' in first.system
    chat = to_chat(first)
    assert chat[0] == {"role": "system", "content": first.system}
    assert chat[1:] == first.messages


# --- BFCL schemas ---------------------------------------------------------------------------------


def test_bfcl_schema_converts_types_at_every_depth_and_keeps_names() -> None:
    tool = {
        "name": "f",
        "parameters": {
            "type": "dict",
            "properties": {
                "type": {"type": "string", "description": "a parameter named type"},
                "point": {"type": "tuple", "items": {"type": "float"}},
                "options": {"type": "dict", "properties": {"deep": {"type": "dict", "properties": {}}}},
                "anything": {"type": "any"},
                "either": {"type": ["dict", "null"]},
                "kind": {"type": "string", "enum": ["dict", "list"]},
            },
            "required": ["type"],
        },
    }
    out = bfcl_schema(tool)
    params = out["parameters"]
    assert params["type"] == "object"
    props = params["properties"]
    assert props["type"] == {"type": "string", "description": "a parameter named type"}
    assert props["point"] == {"type": "array", "items": {"type": "number"}}
    assert props["options"]["type"] == "object" and props["options"]["properties"]["deep"]["type"] == "object"
    assert props["anything"] == {"type": "string"}
    assert props["either"] == {"type": ["object", "null"]}
    assert props["kind"]["enum"] == ["dict", "list"]  # values are data, not types
    assert params["required"] == ["type"]
    assert tool["parameters"]["type"] == "dict"  # the input is not modified


# --- small files of every format --------------------------------------------------------------------


def test_turns_records(tmp_path: Path) -> None:
    path = _write(tmp_path, "mt.jsonl", [
        {"question_id": 7, "category": "coding", "turns": ["first", "second"]},
        "",  # blank lines are skipped
        {"turns": ["only"]},
    ])
    a, b = load_prompts(path)
    assert a == PromptRecord(id="7", dataset="mt", category="coding", system=None, turns=["first", "second"])
    assert b.id == "1" and b.category is None  # no id: the record's index in the file


def test_humaneval_style_record_is_wrapped_but_a_plain_prompt_is_not(tmp_path: Path) -> None:
    path = _write(tmp_path, "code.jsonl", [
        {"task_id": "T/0", "prompt": "def f(x):\n", "entry_point": "f"},
        {"id": "p1", "prompt": "Tell me a story.", "category": "writing", "system": "Be brief."},
    ])
    code, plain = load_prompts(path)
    assert code.id == "T/0" and code.turns == [CODE_INSTRUCTION.format(prompt="def f(x):\n")]
    assert code.turns[0].endswith("```python\ndef f(x):\n```")
    assert plain.turns == ["Tell me a story."] and plain.category == "writing" and plain.system == "Be brief."
    assert to_chat(plain) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me a story."},
    ]


def test_messages_record_keeps_its_chat(tmp_path: Path) -> None:
    chat = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "u0"},
        {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "u1"},
    ]
    (rec,) = load_prompts(_write(tmp_path, "chat.jsonl", [{"id": "c", "messages": chat}]))
    assert rec.system == "You are terse." and rec.turns == ["u0", "u1"] and rec.messages == chat[1:]
    assert to_chat(rec, 0) == chat[:2]
    assert to_chat(rec, 1) == chat  # the record's own earlier reply
    own = [{"role": "user", "content": "u0"}, {"role": "assistant", "content": "mine"}]
    assert to_chat(rec, 1, history=own) == [chat[0], *own, chat[3]]


def test_bfcl_record(tmp_path: Path) -> None:
    obj = {
        "id": "simple_9",
        "question": [[{"role": "user", "content": "Area of a 3 by 4 rectangle?"}]],
        "function": [{"name": "area", "description": "d", "parameters": {"type": "dict", "properties": {}}}],
    }
    (rec,) = load_prompts(_write(tmp_path, "BFCL_v4_x.json", [obj]))
    assert rec.id == "simple_9" and rec.dataset == "BFCL_v4_x"
    assert rec.turns == ["Area of a 3 by 4 rectangle?"] and rec.messages == obj["question"][0]
    tool_line = '{"name": "area", "description": "d", "parameters": {"type": "object", "properties": {}}}'
    assert tool_line in rec.system.splitlines()
    assert '{"name": "<tool name>", "arguments":' in rec.system


def test_to_chat_later_turn_needs_history() -> None:
    rec = PromptRecord(id="1", dataset="d", category=None, system="S", turns=["t0", "t1"])
    with pytest.raises(ValueError, match="history"):
        to_chat(rec, 1)
    history = [{"role": "user", "content": "t0"}, {"role": "assistant", "content": "r0"}]
    assert to_chat(rec, 1, history) == [{"role": "system", "content": "S"}, *history, {"role": "user", "content": "t1"}]
    with pytest.raises(IndexError):
        to_chat(rec, 2)


@pytest.mark.parametrize(
    "bad_line,message",
    [
        ('{"turns": ["ok"]', "not valid JSON"),
        ('["a", "list"]', "expected a JSON object"),
        ('{"id": 3, "text": "no known field"}', "none of 'turns', 'messages', 'prompt'"),
        ('{"turns": []}', "'turns' must be a non-empty list"),
        ('{"messages": [{"role": "user"}]}', "string 'role' and 'content'"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "no user message"),
        ('{"prompt": 5}', "'prompt' must be a non-empty string"),
        ('{"question": [], "function": []}', "'question' must be a non-empty list"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    path = _write(tmp_path, "bad.jsonl", [{"turns": ["fine"]}, "", bad_line])
    with pytest.raises(ValueError, match=message) as info:
        load_prompts(path)
    assert str(info.value).startswith(f"{path}:3: ")


def test_limit_stops_before_a_later_bad_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}, "not json"])
    assert [r.turns for r in load_prompts(path, limit=2)] == [["a"], ["b"]]
    assert load_prompts(path, limit=0) == []
    with pytest.raises(ValueError, match=r"p\.jsonl:3"):
        load_prompts(path)


def test_any_jsonl_with_prompt_messages_or_turns_and_categories(tmp_path: Path) -> None:
    """A user's own prompt set: the three generic shapes mixed in one file, categories optional, extra
    fields (Spec-Bench's `reference`) ignored."""
    lines = [
        {"question_id": "sb1", "category": "translation", "turns": ["Translate: hello", "Now to German"],
         "reference": ["bonjour"]},
        {"prompt": "Summarize: a long text", "category": "summarization"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                      {"role": "user", "content": "bye"}], "category": 3},
        {"prompt": "no category here"},
    ]
    records = load_prompts(_write(tmp_path, "mine.jsonl", lines))
    assert [r.id for r in records] == ["sb1", "1", "2", "3"]
    assert [r.category for r in records] == ["translation", "summarization", "3", None]
    assert [len(r.turns) for r in records] == [2, 1, 2, 1]
    assert all(r.dataset == "mine" for r in records)
    assert to_chat(records[1]) == [{"role": "user", "content": "Summarize: a long text"}]
    # a later turn with the model's own reply in place of the record's
    own = to_chat(records[2], 0) + [{"role": "assistant", "content": "mine"}]
    assert to_chat(records[2], 1, own)[-2:] == [
        {"role": "assistant", "content": "mine"}, {"role": "user", "content": "bye"},
    ]


def test_bundled_sets_resolve_by_name_from_any_directory(tmp_path, monkeypatch) -> None:
    """A fresh clone (or an installed wheel) with nothing beside it: the dev sets are found by name
    wherever the command runs, and every one of them parses."""
    monkeypatch.chdir(tmp_path)
    for name, rel in DEV_SETS:
        path = resolve_dataset(name)
        assert path == PROMPTS_DIR / rel and path.is_file()
        assert len(load_prompts(path, 3)) == 3
    assert (PROMPTS_DIR / "PROVENANCE.md").is_file()
    own = _write(tmp_path, "mine.jsonl", [{"prompt": "hi"}])
    assert resolve_dataset("mine.jsonl") == own.relative_to(tmp_path)
    with pytest.raises(ValueError, match="neither a file nor a development set.*humaneval"):
        resolve_dataset("no-such-set")


def test_the_multi_session_workloads_repeat_what_agents_repeat() -> None:
    from tandem.tools.datasets import WORKLOADS, workload

    agents = workload("agent_tools")
    assert len(agents) == 12 and len({r.system for r in agents}) == 1  # one tool list for every session
    assert all(len(r.turns) == 2 and r.turns[0] != r.turns[1] for r in agents)
    assert {tuple(r.turns) for r in agents} == {(a, b) for a in {r.turns[0] for r in agents}
                                                for b in {r.turns[0] for r in agents} if a != b}
    assert [f["name"] for f in agents[0].functions] and '"type": "object"' in agents[0].system
    long = workload("agent_turns")  # every order of agent_tools' four questions, one session each
    assert len(long) == 24 and {r.system for r in long} == {agents[0].system}
    assert len({tuple(r.turns) for r in long}) == 24 and all(sorted(r.turns) == sorted(long[0].turns) for r in long)
    code = workload("code_twice")
    assert len(code) == 16 and [r.category for r in code[:2]] == ["first", "renamed"]
    first, again = code[0].turns[0], code[1].turns[0]
    assert "has_close_elements_v2" in again and again.replace("has_close_elements_v2", "has_close_elements") == first
    assert len(workload("code_twice", 3)) == 3
    with pytest.raises(KeyError, match="known: agent_tools, agent_turns, code_twice"):
        workload("nope")
    assert set(WORKLOADS) == {"agent_tools", "agent_turns", "code_twice"}
