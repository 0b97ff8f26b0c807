"""Tool calling at the gateway: render tools into the prompt, constrain the output when a call is
required, and parse calls out of the text. Transport-free (http.py turns the result into OpenAI's
`message.tool_calls`).

Rendering. A chat template that knows `tools` (it renders differently with them) gets them as
they are. One that does not (the embedded SmolLM2's) gets the Hermes-style convention instead: a
system preamble listing the functions as JSON schemas and asking for calls written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; earlier assistant calls and `tool`
results of the session are rendered in the same convention, so multi-turn tool use works.

tool_choice. "none": no tools rendered, no parsing. "auto": the model decides; calls are parsed out
of the text. "required" or a named function: the output is constrained by a JSON-schema grammar to
exactly one call object {"name", "arguments"} of the allowed functions, verified like any grammar
(speculation on or off, the same call).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from tandem.engine.config import Grammar
from tandem.services.gateway.errors import InvalidRequest

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def _functions(tools: list[dict]) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        fn = tool["function"]
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", fn["name"]):
            raise InvalidRequest(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '.' or '-'")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
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
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        picked = [f for f in fns if f["name"] == name]
        if not picked:
            raise InvalidRequest(f"tool_choice names function {str(name)[:64]!r}, which is not among the tools")
        return picked, "required"
    raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}")


def call_grammar(fns: list[dict]) -> Grammar:
    """One call object of the allowed functions, its arguments checked against their schema."""
    options = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return Grammar(kind="json_schema", value=json.dumps(schema, sort_keys=True))


def _preamble(fns: list[dict]) -> str:
    listing = "\n".join(json.dumps({"type": "function", "function": f}) for f in fns)
    return ("You can call functions. Their signatures, as JSON schemas:\n<tools>\n" + listing + "\n</tools>\n"
            "To call one, answer with <tool_call>{\"name\": <function name>, \"arguments\": <arguments object>}"
            "</tool_call> for each call.")


def _as_text(message: dict) -> dict:
    """An assistant message with tool_calls, or a tool result, in the Hermes convention."""
    out = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id", "name")}
    if message.get("tool_calls"):
        calls = []
        for c in message["tool_calls"]:
            fn = c.get("function", {}) if isinstance(c, dict) else {}
            args = fn.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                raise InvalidRequest("an assistant tool call's arguments are not JSON") from None
            calls.append(f"<tool_call>{json.dumps({'name': fn.get('name'), 'arguments': args})}</tool_call>")
        out["content"] = ((message.get("content") or "") + "".join(calls)).strip()
    if message.get("role") == "tool":
        out["content"] = f"<tool_response>{message.get('content') or ''}</tool_response>"
    return out


HERMES = "hermes"  # tool_format: our <tool_call> convention, for a template without tool support
TEMPLATE = "template"  # tool_format: the chat template renders the tools itself

_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "", "parameters": {"type": "object", "properties": {}}}}


def tool_format(tokenizer) -> str:
    """Whether the model's chat template renders tools (TEMPLATE: it changes its output when given
    one) or requests with tools get our Hermes-style convention (HERMES)."""
    if not getattr(tokenizer, "chat_template", None):
        return HERMES
    chat = [{"role": "user", "content": "hi"}]
    try:
        with_tools = tokenizer.apply_chat_template(chat, tools=[_PROBE_TOOL], add_generation_prompt=True, tokenize=False)
        without = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    except Exception:
        return HERMES
    return TEMPLATE if with_tools != without else HERMES


def render(tokenizer, messages: list[dict], fns: list[dict], apply) -> list[int]:
    """Token ids of the chat with the tools, by the template's own tool support when it has one."""
    if fns and getattr(tokenizer, "chat_template", None):
        try:
            with_tools = tokenizer.apply_chat_template(messages, tools=[{"type": "function", "function": f} for f in fns],
                                                       add_generation_prompt=True, tokenize=False)
            without = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception:
            with_tools = without = None
        if with_tools is not None and with_tools != without:  # the template knows tools
            ids = tokenizer(with_tools, add_special_tokens=False)["input_ids"]
            return [int(t) for t in ids]
    converted = [_as_text(m) for m in messages]
    if fns:
        if converted and converted[0].get("role") == "system":
            converted[0] = {**converted[0], "content": f"{converted[0]['content']}\n\n{_preamble(fns)}"}
        else:
            converted.insert(0, {"role": "system", "content": _preamble(fns)})
    return apply(tokenizer, converted)


def parse(text: str, fns: list[dict], mode: str) -> tuple[str | None, list[ToolCall]]:
    """(the content left, the calls) of a completion. Required mode: the text is the call object."""
    names = {f["name"] for f in fns}

    def call(obj) -> ToolCall | None:
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        args = obj.get("arguments", {})
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(args))

    if mode == "none" or not fns:
        return text, []
    if mode == "required":
        try:
            c = call(json.loads(text))
        except ValueError:
            c = None
        return (None, [c]) if c is not None else (text, [])
    calls = []
    for block in _CALL.findall(text):
        try:
            c = call(json.loads(block))
        except ValueError:
            c = None
        if c is not None:
            calls.append(c)
    if not calls:
        return text, []
    content = _CALL.sub("", text).strip()
    return (content or None), calls
