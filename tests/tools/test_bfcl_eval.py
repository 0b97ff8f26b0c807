"""The BFCL scorer of scripts/bfcl_eval.py: BFCL's parameter types as JSON Schema, and the AST match
as BFCL defines it (name, required arguments, no unknown ones, values among the allowed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bfcl_eval", ROOT / "scripts" / "bfcl_eval.py")
bfcl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bfcl)

QUESTION = {"function": [{"name": "area", "parameters": {"type": "dict", "properties": {
    "base": {"type": "integer"}, "height": {"type": "float"}, "unit": {"type": "string"},
    "sides": {"type": "tuple", "items": {"type": "integer"}}}, "required": ["base", "height"]}}]}
ANSWER = {"ground_truth": [{"area": {"base": [10], "height": [5.0], "unit": ["units", ""]}}]}


def test_types_become_json_schema():
    schema = bfcl.to_json_schema(QUESTION["function"][0]["parameters"])
    assert schema["type"] == "object" and schema["properties"]["height"]["type"] == "number"
    assert schema["properties"]["sides"] == {"type": "array", "items": {"type": "integer"}}


def test_ast_match():
    assert bfcl.ast_match("area", {"base": 10, "height": 5}, QUESTION, ANSWER)
    assert bfcl.ast_match("area", {"base": 10, "height": 5, "unit": "Units"}, QUESTION, ANSWER)
    assert not bfcl.ast_match("area", {"base": 11, "height": 5}, QUESTION, ANSWER)  # wrong value
    assert not bfcl.ast_match("area", {"base": 10}, QUESTION, ANSWER)  # a required one missing
    assert not bfcl.ast_match("area", {"base": 10, "height": 5, "color": "red"}, QUESTION, ANSWER)  # unknown
    assert not bfcl.ast_match("volume", {"base": 10, "height": 5}, QUESTION, ANSWER)  # wrong function
