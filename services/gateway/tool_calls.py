"""Tool calling at the gateway: render tools into the prompt, constrain the output when a call is
required, and parse calls out of the text. Transport-free (http.py turns the result into OpenAI's
`message.tool_calls`).

Model families write calls differently, so the gateway learns once, at start, how its model does
(`detect`): a chat template that renders `tools` (its output changes when given one) and whose
convention is one we parse gets them as they are, and calls are parsed in that family's dialect:

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the text, any
  number (Hermes, Qwen 2.5 / 3, and our own convention below);
- `llama3`: the response is the call object `{"name": ..., "parameters": {...}}` (Llama 3.1 to
  3.3's JSON tool calling), after an optional `<|python_tag|>`, several separated by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON array of call objects (the marker is a special token, so a
  text decoded without special tokens starts with the array itself).

A template without tool support (the embedded SmolLM2's), or one whose calls we cannot parse, gets
the gateway's Hermes-style convention instead: a system preamble listing the functions as JSON
schemas and asking for `<tool_call>` calls; earlier assistant calls and `tool` results of the
session are rendered in the same convention, so multi-turn tool use works. The gateway logs which
at start and every response with tools says it (`tandem.tool_format`, e.g. `template/llama3` or
`gateway/hermes`); `--no-tool-fallback` refuses tools rather than use the convention.

tool_choice. "none": no tools rendered, no parsing. "auto": the model decides; calls are parsed out
of the text. "required" or a named function: the output is constrained by a JSON-schema grammar to
exactly one call object {"name", <the dialect's arguments key>} of the allowed functions, verified
like any grammar (speculation on or off, the same call). parallel_tool_calls false keeps the first
call the model wrote.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field

from tandem.contract.params import Grammar
from tandem.services.gateway.errors import InvalidRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


# -- dialects: how a model family writes calls -----------------------------------------------------

_JSON = json.JSONDecoder()


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (a marker still arriving)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _decode_at(text: str, at: int):
    """(the JSON value starting at `at`, the index after it), or (None, at) if there is none."""
    try:
        return _JSON.raw_decode(text, at)
    except ValueError:
        return None, at


class Dialect:
    """One family's way of writing calls. `spans` finds them, `hold_from` says where a stream must
    stop sending text because a call may have begun there."""

    name = ""
    args_key = "arguments"  # the call object's key for its arguments

    def spans(self, text: str) -> list[tuple[int, int, dict]]:
        """(start, end, call object) of every call written in `text`, in order; a span's text is
        dropped from the content."""
        raise NotImplementedError

    def hold_from(self, text: str) -> int:
        """Characters of `text` (a stream's text so far) that are content whatever follows."""
        raise NotImplementedError


class Hermes(Dialect):
    name = "hermes"
    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def spans(self, text):
        out = []
        for m in self._BLOCK.finditer(text):
            obj, end = _decode_at(m.group(1), 0)
            if isinstance(obj, dict) and not m.group(1)[end:].strip():
                out.append((m.start(), m.end(), obj))
        return out

    def hold_from(self, text):
        at = text.find(self._OPEN)
        return at if at >= 0 else len(text) - _partial_marker(text, self._OPEN)


class Llama3(Dialect):
    name = "llama3"
    args_key = "parameters"
    _TAG = "<|python_tag|>"

    def spans(self, text):
        at = len(text) - len(text.lstrip())
        start = at
        if text.startswith(self._TAG, at):
            at += len(self._TAG)
        out = []
        while True:
            while at < len(text) and text[at] in " \t\r\n;":
                at += 1
            obj, end = _decode_at(text, at)
            if not isinstance(obj, dict) or "name" not in obj:
                return out
            out.append((start, end, obj))
            at = start = end

    def hold_from(self, text):
        head = text.lstrip()
        if not head or head.startswith("{") or self._TAG.startswith(head[: len(self._TAG)]):
            return 0  # nothing yet, or the response is (becoming) a call
        return len(text)


class Mistral(Dialect):
    name = "mistral"
    _MARK = "[TOOL_CALLS]"

    def spans(self, text):
        at = text.find(self._MARK)
        if at >= 0:
            start, after = at, at + len(self._MARK)
        else:  # decoded without special tokens: the array opens the response
            start = after = len(text) - len(text.lstrip())
            if not text.startswith("[", after):
                return []
        value, end = _decode_at(text, after + len(text[after:]) - len(text[after:].lstrip()))
        calls = value if isinstance(value, list) else [value] if isinstance(value, dict) else []
        if not calls or not all(isinstance(c, dict) and "name" in c for c in calls):
            return []
        # The marker and the array are one span, which every call of it shares.
        return [(start, end, c) for c in calls]

    def hold_from(self, text):
        at = text.find(self._MARK)
        if at >= 0:
            return at
        if text.lstrip().startswith("[") or not text.strip():
            return 0
        return len(text) - _partial_marker(text, self._MARK)


DIALECTS = {d.name: d for d in (Hermes(), Llama3(), Mistral())}


# -- what the gateway's model supports --------------------------------------------------------------

TEMPLATE = "template"  # the chat template renders the tools itself
GATEWAY = "gateway"  # the gateway's Hermes-style convention (preamble, <tool_call>)

_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "", "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class ToolSupport:
    renderer: str  # TEMPLATE | GATEWAY
    dialect: Dialect = field(default_factory=Hermes)
    why: str = ""  # for GATEWAY: why the template is not used

    @property
    def label(self) -> str:
        """What responses with tools say in tandem.tool_format: "template/llama3", "gateway/hermes"."""
        return f"{self.renderer}/{self.dialect.name}"


def _dialect_of(template: str, rendered: str) -> Dialect | None:
    """The family a template's tool convention belongs to, by the markers it writes or teaches."""
    both = template + "\n" + rendered
    if "<tool_call>" in both:
        return DIALECTS["hermes"]
    if "[TOOL_CALLS]" in both or "[AVAILABLE_TOOLS]" in both:
        return DIALECTS["mistral"]
    if "<|python_tag|>" in both or "ipython" in template:  # Llama 3.1+: its tool results' role
        return DIALECTS["llama3"]
    return None


def detect(tokenizer) -> ToolSupport:
    """How requests with tools are rendered and their calls parsed, for this tokenizer's model."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return ToolSupport(GATEWAY, why="has no chat template")
    chat = [{"role": "user", "content": "hi"}]
    try:
        with_tools = tokenizer.apply_chat_template(chat, tools=[_PROBE_TOOL], add_generation_prompt=True, tokenize=False)
        without = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    except Exception as exc:
        return ToolSupport(GATEWAY, why=f"fails to render tools ({str(exc)[:120]})")
    if with_tools == without:
        return ToolSupport(GATEWAY, why="has no tool support")
    dialect = _dialect_of(template if isinstance(template, str) else json.dumps(template), with_tools)
    if dialect is None:
        return ToolSupport(GATEWAY, why="renders tools, but in a call format the gateway does not parse "
                                        f"(it knows {', '.join(DIALECTS)})")
    return ToolSupport(TEMPLATE, dialect)


# -- a request's tools --------------------------------------------------------------------------------


def _functions(tools: list[dict]) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        fn = tool["function"]
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", fn["name"]):
            raise InvalidRequest(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '.' or '-'")
        if not isinstance(fn.get("description", ""), str):
            raise InvalidRequest(f"tools[{i}].function.description must be a string")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        elif not isinstance(params, dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append({"name": fn["name"], "description": fn.get("description", ""), "parameters": params})
    if len({f["name"] for f in out}) != len(out):
        raise InvalidRequest("tool function names must be unique")
    return out


def chosen(tools: list[dict], tool_choice) -> tuple[list[dict], str]:
    """(the functions the model may call, the mode: "none" | "auto" | "required")."""
    fns = _functions(tools)
    if tool_choice in (None, "auto"):
        return fns, "auto" if fns else "none"
    if tool_choice == "none":
        return [], "none"
    if tool_choice == "required":
        if not fns:
            raise InvalidRequest("tool_choice 'required' needs tools")
        return fns, "required"
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        picked = [f for f in fns if f["name"] == name]
        if not picked:
            raise InvalidRequest(f"tool_choice names function {str(name)[:64]!r}, which is not among the tools")
        return picked, "required"
    raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}")


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools as the response needs them: what may be called, how, in which dialect."""

    fns: tuple = ()
    mode: str = "none"  # "none" | "auto" | "required"
    dialect: Dialect = field(default_factory=Hermes)
    parallel: bool = True  # parallel_tool_calls: false keeps the first call


NO_TOOLS = ToolPlan()


def call_grammar(fns: list[dict], dialect: Dialect | None = None) -> Grammar:
    """One call object of the allowed functions, its arguments checked against their schema, with
    the arguments under the key the model's family writes them."""
    key = (dialect or DIALECTS["hermes"]).args_key
    options = [{"type": "object", "properties": {"name": {"const": f["name"]}, key: f["parameters"]},
                "required": ["name", key], "additionalProperties": False} for f in fns]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return Grammar(kind="json_schema", value=json.dumps(schema, sort_keys=True))


# -- rendering ----------------------------------------------------------------------------------------


def _preamble(fns: list[dict]) -> str:
    listing = "\n".join(json.dumps({"type": "function", "function": f}) for f in fns)
    return ("You can call functions. Their signatures, as JSON schemas:\n<tools>\n" + listing + "\n</tools>\n"
            "To call one, answer with <tool_call>{\"name\": <function name>, \"arguments\": <arguments object>}"
            "</tool_call> for each call.")


def _arguments(call) -> tuple[str | None, object]:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    args = fn.get("arguments", "{}")
    try:
        return fn.get("name"), json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise InvalidRequest("an assistant tool call's arguments are not JSON") from None


def _as_text(message: dict) -> dict:
    """An assistant message with tool_calls, or a tool result, in the Hermes convention."""
    out = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id", "name")}
    if message.get("tool_calls"):
        calls = []
        for c in message["tool_calls"]:
            name, args = _arguments(c)
            calls.append(f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>")
        out["content"] = ((message.get("content") or "") + "".join(calls)).strip()
    if message.get("role") == "tool":
        out["content"] = f"<tool_response>{message.get('content') or ''}</tool_response>"
    return out


def _for_template(message: dict) -> dict:
    """A message as chat templates take it: OpenAI sends a call's arguments as JSON text, templates
    (transformers' convention) expect the object."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for c in message["tool_calls"]:
        name, args = _arguments(c)
        calls.append({**c, "type": "function", "function": {"name": name, "arguments": args}})
    return {**message, "tool_calls": calls}


def render(tokenizer, messages: list[dict], fns: list[dict], apply, support: ToolSupport) -> list[int]:
    """Token ids of the chat with the tools: by the template when it supports them, else by the
    gateway's convention."""
    if support.renderer == TEMPLATE:
        text = tokenizer.apply_chat_template([_for_template(m) for m in messages],
                                             tools=[{"type": "function", "function": f} for f in fns] or None,
                                             add_generation_prompt=True, tokenize=False)
        return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    converted = [_as_text(m) for m in messages]
    if fns:
        if converted and converted[0].get("role") == "system":
            converted[0] = {**converted[0], "content": f"{converted[0]['content']}\n\n{_preamble(fns)}"}
        else:
            converted.insert(0, {"role": "system", "content": _preamble(fns)})
    return apply(tokenizer, converted)


# -- parsing ------------------------------------------------------------------------------------------


def _call(obj, plan: ToolPlan) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in {f["name"] for f in plan.fns}:
        return None
    args = obj.get(plan.dialect.args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(args))


def calls_in(text: str, plan: ToolPlan) -> tuple[list[tuple[int, int]], list[ToolCall]]:
    """(the spans of text the calls take, the calls) of a completion, in the plan's dialect; a
    required call is the whole text (the grammar wrote it)."""
    if plan.mode == "none" or not plan.fns:
        return [], []
    if plan.mode == "required":
        obj, end = _decode_at(text, len(text) - len(text.lstrip()))
        c = _call(obj, plan) if not text[end:].strip() else None
        return ([(0, len(text))], [c]) if c is not None else ([], [])
    spans, calls = [], []
    for start, end, obj in plan.dialect.spans(text):
        c = _call(obj, plan)
        if c is not None:
            spans.append((start, end))
            calls.append(c)
    if not plan.parallel:
        calls = calls[:1]
    return spans, calls


def without(text: str, spans: list[tuple[int, int]], start: int = 0) -> str:
    """`text[start:]` with the spans cut out."""
    out, at = [], start
    for s, e in spans:
        if e <= at:
            continue
        out.append(text[at:max(s, at)])
        at = e
    out.append(text[at:])
    return "".join(out)


def parse(text: str, plan: ToolPlan) -> tuple[str | None, list[ToolCall]]:
    """(the content left, the calls) of a completion."""
    spans, calls = calls_in(text, plan)
    if not calls:
        return text, []
    return (without(text, spans).strip() or None), calls
