"""Prompt sets for benchmarks: JSON-lines files read into one record type.

A record's shape decides how it is read (the formats of prompts/PROVENANCE.md beside this file):

    {"question": [[{role, content}, ...]], "function": [...]}    BFCL: tools go into the system prompt
    {"turns": ["...", "..."], "category", "question_id"}         MT-Bench, GSM8K (EAGLE's files)
    {"messages": [{role, content}, ...]}                         a chat
    {"prompt": "def f(...", "entry_point": "f", "task_id"}       HumanEval: code to complete
    {"prompt": "..."}                                            plain text

with optional `id` (or `question_id` / `task_id`), `category` and `system` on any of them.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class PromptRecord:
    id: str
    dataset: str  # the file's stem, e.g. "HumanEval", "BFCL_v4_multiple"
    category: str | None
    system: str | None
    turns: list[str]  # the user messages, in order; a benchmark feeds turns[0] (and later turns after it)
    # The full chat when the record gives one, without its system message (that is `system`). Its user
    # messages are `turns`; assistant messages between them are the record's own earlier replies.
    messages: list[dict] | None = None
    # BFCL: the functions offered, as the API's tools take them ({name, description, parameters} in
    # JSON Schema terms), and the system message without the tool list that `system` carries; a
    # benchmark may pass the functions as tools instead (`tandem bench --tools`).
    functions: list[dict] | None = None
    system_without_tools: str | None = None


# HumanEval is a base-model completion set, but the default target is a chat model: given the bare
# code through its chat template it tends to talk about the code instead of finishing it. Asking for
# the whole function in a code block keeps the answer code, which is what the benchmark measures
# (and where prompt lookup has the prompt's signature and docstring to copy from).
CODE_INSTRUCTION = (
    "Complete the following Python function. Return the whole function in a Python code block.\n\n"
    "```python\n{prompt}```"
)

TOOLS_INSTRUCTION = (
    "You can call the following tools, given as JSON Schema:\n{tools}\n\n"
    "To call a tool, answer with only a JSON object of the form "
    '{{"name": "<tool name>", "arguments": {{"<parameter>": <value>, ...}}}}.'
)

# BFCL writes some parameter types as Python names. These are the ones its own OpenAI-style handlers
# translate (bfcl_eval's GORILLA_TO_OPENAPI) and that its Python sets use.
_BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string"}


def load_prompts(path: str | Path, limit: int | None = None) -> list[PromptRecord]:
    """Read the first `limit` records (all when None) of a JSON-lines prompt file.

    Raises ValueError naming the file and line of a malformed line or of a record with none of the
    known fields; lines after the limit are not read.
    """
    path = Path(path)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    records: list[PromptRecord] = []
    if limit == 0:
        return records
    for lineno, obj in _json_lines(path):
        try:
            records.append(_record(obj, dataset=path.stem, default_id=str(len(records))))
        except ValueError as exc:
            raise ValueError(f"{path}:{lineno}: {exc}") from None
        if limit is not None and len(records) >= limit:
            break
    return records


def to_chat(record: PromptRecord, turn_index: int = 0, history: list[dict] | None = None) -> list[dict]:
    """The messages to send for user turn `turn_index` of `record`: the system message first when
    there is one, then the earlier turns, then this turn's user message.

    `history` is the chat of the earlier turns (user and assistant messages, no system message), as
    the caller generated it. Without it, a record that carries a chat uses its own earlier messages,
    and a later turn of any other record is an error: its answer depends on the earlier replies.

    Example: MT-Bench turn 1 with history [user turns[0], assistant reply] gives
    [user turns[0], assistant reply, user turns[1]].
    """
    if not 0 <= turn_index < len(record.turns):
        raise IndexError(f"prompt {record.id!r} has {len(record.turns)} turn(s); no turn {turn_index}")
    head = [{"role": "system", "content": record.system}] if record.system else []
    if history is not None:
        return head + list(history) + [{"role": "user", "content": record.turns[turn_index]}]
    if record.messages is not None:
        return head + _through_user_turn(record.messages, turn_index)
    if turn_index > 0:
        raise ValueError(
            f"turn {turn_index} of prompt {record.id!r} follows the model's earlier replies: pass them as history"
        )
    return head + [{"role": "user", "content": record.turns[0]}]


def bfcl_schema(value, types: dict[str, str | None] = _BFCL_TYPES, drop: tuple[str, ...] = ()):
    """A copy of a BFCL tool schema in JSON Schema terms: every `"type": "dict"` becomes "object"
    (and the other Python type names of `types` their JSON Schema names; one mapped to None loses
    its `type`), at any depth; keys named in `drop` go.

    Only values of `type` keys change: a parameter that is itself *named* "type" keeps its name.
    """
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "type" and isinstance(item, str):
                if types.get(item, item) is not None:
                    out[key] = types.get(item, item)
            elif key == "type" and isinstance(item, list) and all(isinstance(t, str) for t in item):
                out[key] = [types.get(t, t) for t in item]
            elif key not in drop:
                out[key] = bfcl_schema(item, types, drop)
        return out
    if isinstance(value, list):
        return [bfcl_schema(item, types, drop) for item in value]
    return value


def tools_system_prompt(functions: list[dict]) -> str:
    """The system prompt that offers `functions` (BFCL tool schemas) to the model, one tool a line."""
    tools = "\n".join(json.dumps(bfcl_schema(f), ensure_ascii=False) for f in functions)
    return TOOLS_INSTRUCTION.format(tools=tools)


def _json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def _record(obj: dict, *, dataset: str, default_id: str) -> PromptRecord:
    rid = next((obj[k] for k in ("id", "question_id", "task_id") if obj.get(k) is not None), default_id)
    category = obj.get("category")
    system = _optional_str(obj, "system")
    messages: list[dict] | None = None
    api_functions: list[dict] | None = None
    without: str | None = None

    if "question" in obj and "function" in obj:  # BFCL
        question = obj["question"]
        if not isinstance(question, list) or not question:
            raise ValueError("'question' must be a non-empty list of conversations")
        own_system, messages = _split_system(_chat(question[0], "question[0]"))
        functions = obj["function"]
        if not isinstance(functions, list) or not all(isinstance(f, dict) for f in functions):
            raise ValueError("'function' must be a list of tool schemas")
        without = "\n\n".join(s for s in (own_system, system) if s) or None
        system = "\n\n".join(s for s in (tools_system_prompt(functions), without) if s)
        turns = _user_turns(messages, "question[0]")
        api_functions = [{"name": f.get("name"), "description": f.get("description", ""),
                          "parameters": bfcl_schema(f.get("parameters") or {"type": "object", "properties": {}})}
                         for f in functions]
    elif "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError("'turns' must be a non-empty list of strings")
        turns = list(turns)
    elif "messages" in obj:
        own_system, messages = _split_system(_chat(obj["messages"], "messages"))
        system = "\n\n".join(s for s in (own_system, system) if s) or None
        turns = _user_turns(messages, "messages")
    elif "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("'prompt' must be a non-empty string")
        turns = [CODE_INSTRUCTION.format(prompt=prompt) if "entry_point" in obj else prompt]
    else:
        raise ValueError(
            f"record has none of 'turns', 'messages', 'prompt' or 'question'+'function' (keys: {sorted(obj)})"
        )
    return PromptRecord(
        id=str(rid),
        dataset=dataset,
        category=None if category is None else str(category),
        system=system,
        turns=turns,
        messages=messages,
        functions=api_functions,
        system_without_tools=without,
    )


def _optional_str(obj: dict, key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"'{key}' must be a string")
    return value or None


def _chat(value, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"'{where}' must be a non-empty list of messages")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"'{where}'[{i}] must be an object with string 'role' and 'content'")
    return [dict(m) for m in value]


def _split_system(messages: list[dict]) -> tuple[str | None, list[dict]]:
    if messages[0]["role"] == "system":
        return messages[0]["content"], messages[1:]
    return None, messages


def _user_turns(messages: list[dict], where: str) -> list[str]:
    turns = [m["content"] for m in messages if m["role"] == "user"]
    if not turns:
        raise ValueError(f"'{where}' has no user message")
    return turns


def _through_user_turn(messages: list[dict], turn_index: int) -> list[dict]:
    """The messages up to and including the turn_index-th user message (0-based)."""
    seen = -1
    for i, m in enumerate(messages):
        if m["role"] == "user":
            seen += 1
            if seen == turn_index:
                return messages[: i + 1]
    raise IndexError(f"no user turn {turn_index}")


# The public prompt sets this project benchmarks and distils on ship inside the package, unchanged,
# with their licences and provenance (prompts/PROVENANCE.md), so every command and test works from
# any directory of a fresh clone or an installed wheel.
PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"

# The development sets: (short name, path under PROMPTS_DIR).
DEV_SETS = [
    ("bfcl_multiple", "bfcl/BFCL_v4_multiple.json"),
    ("humaneval", "HumanEval.jsonl"),
    ("gsm8k", "gsm8k_question.jsonl"),
    ("mt_bench", "mt_bench_question.jsonl"),
]


def dev_set(name: str) -> Path:
    """The file of a development set by short name (`humaneval`, `mt_bench`, ...)."""
    for short, rel in DEV_SETS:
        if short == name:
            return PROMPTS_DIR / rel
    raise KeyError(f"no development set {name!r}; known: {', '.join(n for n, _ in DEV_SETS)}")


def resolve_dataset(spec: str | Path) -> Path:
    """A prompt-set argument: a development set's short name, or a file path. Raises ValueError
    saying what exists when it is neither."""
    if str(spec) in {n for n, _ in DEV_SETS}:
        return dev_set(str(spec))
    path = Path(spec)
    if path.is_file():
        return path
    raise ValueError(
        f"{spec} is neither a file nor a development set (known sets: {', '.join(n for n, _ in DEV_SETS)})"
    )


# -- derived multi-session workloads (built from the development sets, deterministic) ----------------
#
# Agents repeat themselves across sessions; these sets say so on purpose, for suffix decoding's
# cross-session store (`tandem bench --suffix-warm`): each record is one session, and a warm run
# feeds the store with the answers of the records before it.

WORKLOADS = {
    "agent_tools": "12 two-turn sessions of one agent: the same tool list (the functions of the first "
                   "four BFCL multiple records) in every system prompt, each session asking two of "
                   "their questions",
    "agent_turns": "24 four-turn sessions of the same agent (agent_tools' tool list), each asking the "
                   "four questions in another order: longer histories of their own",
    "code_twice": "the first 8 HumanEval prompts, each asked twice in separate sessions, the second "
                  "time with the function renamed",
}


def workload(name: str, limit: int | None = None) -> list[PromptRecord]:
    """The records of a derived workload (WORKLOADS), at most `limit`."""
    if name in ("agent_tools", "agent_turns"):
        base = load_prompts(dev_set("bfcl_multiple"), 4)
        functions, seen = [], set()
        raw = [json.loads(line) for line in dev_set("bfcl_multiple").read_text().splitlines()[:4]]
        for obj in raw:
            for f in obj["function"]:
                if f["name"] not in seen:
                    seen.add(f["name"])
                    functions.append(f)
        system = tools_system_prompt(functions)
        api = [{"name": f["name"], "description": f.get("description", ""),
                "parameters": bfcl_schema(f.get("parameters") or {"type": "object", "properties": {}})}
               for f in functions]
        questions = [r.turns[0] for r in base]
        if name == "agent_turns":
            orders = list(itertools.permutations(range(len(questions))))
            records = [PromptRecord(id="agent_" + "_".join(map(str, order)), dataset=name, category=f"first_q{order[0]}",
                                    system=system, turns=[questions[i] for i in order], functions=api,
                                    system_without_tools=None)
                       for order in orders]
        else:
            pairs = [(i, j) for i in range(len(questions)) for j in range(len(questions)) if i != j]
            records = [PromptRecord(id=f"agent_{i}_{j}", dataset="agent_tools", category=f"first_q{i}", system=system,
                                    turns=[questions[i], questions[j]], functions=api, system_without_tools=None)
                       for i, j in pairs]
    elif name == "code_twice":
        records = []
        for line in dev_set("humaneval").read_text().splitlines()[:8]:
            obj = json.loads(line)
            entry = obj["entry_point"]
            records.append(_record(obj, dataset="code_twice", default_id=obj["task_id"]))
            renamed = dict(obj, prompt=obj["prompt"].replace(entry, f"{entry}_v2"), task_id=f"{obj['task_id']}/v2",
                           category="renamed")
            records.append(_record(renamed, dataset="code_twice", default_id=renamed["task_id"]))
        for r in records[0::2]:
            r.category = "first"
    else:
        raise KeyError(f"no workload {name!r}; known: {', '.join(WORKLOADS)}")
    return records[:limit] if limit else records


def records_for(spec: str, limit: int | None = None) -> list[PromptRecord]:
    """The records a command's `--dataset` names: a derived workload (WORKLOADS), a development set
    by short name, or a prompt file; at most `limit`. Raises ValueError naming what exists."""
    if spec in WORKLOADS:
        return workload(spec, limit)
    try:
        return load_prompts(resolve_dataset(spec), limit)
    except ValueError as exc:
        raise ValueError(f"{exc}; workloads: {', '.join(WORKLOADS)}") from exc
