"""A Qwen3-Coder parameter's text as the JSON value its tool's schema asks for.

Qwen3-Coder writes every parameter value as bare text; the request's ``tools`` say
what type each one is. The rules are vLLM's ``qwen3_coder`` parser's: ``null`` (any
case) is null; a parameter the schema does not list, or a string type, stays text;
integer types go through ``int``, number types through ``float`` (an integral value
written back as an integer); booleans are ``true`` (any case) or false; objects and
arrays are read as JSON; anything else as a Python literal. A value that does not
convert stays text.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any

_STRING = {"string", "str", "text", "varchar", "char", "enum"}
_INTEGER = ("int", "uint", "long", "short", "unsigned")
_NUMBER = ("num", "float")
_BOOLEAN = {"boolean", "bool", "binary"}
_JSON = ("object", "array", "arr", "dict", "list")


def parameter_schemas(tools: Sequence[Mapping[str, Any]] | None, function: str
                      ) -> Mapping[str, Any]:
    """The ``properties`` of ``function``'s parameters in a request's ``tools`` (empty
    when the function or its schema is not there)."""
    for tool in tools or ():
        spec = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(spec, Mapping) and spec.get("name") == function:
            parameters = spec.get("parameters")
            if isinstance(parameters, Mapping):
                properties = parameters.get("properties")
                return properties if isinstance(properties, Mapping) else {}
            return {}
    return {}


def _type_name(schema: Any) -> str:
    if not isinstance(schema, Mapping) or "type" not in schema:
        return "string"
    kind = schema["type"]
    if isinstance(kind, list):  # ["integer", "null"]: the type a value has when it is one
        kind = next((k for k in kind if str(k).lower() != "null"), "string")
    return str(kind).strip().lower()


def _json_safe(value: Any, text: str) -> Any:
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # a set, bytes, NaN: what JSON cannot carry
        return text
    return value


def convert(text: str, name: str, schemas: Mapping[str, Any]) -> Any:
    """The JSON value of parameter ``name`` written as ``text``."""
    if text.lower() == "null":
        return None
    if name not in schemas:
        return text
    kind = _type_name(schemas[name])
    if kind in _STRING:
        return text
    if kind.startswith(_INTEGER):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(_NUMBER):
        try:
            number = float(text)
            return int(number) if number.is_integer() else _json_safe(number, text)
        except (ValueError, OverflowError):
            return text
    if kind in _BOOLEAN:
        return text.lower() == "true"
    if kind.startswith(_JSON):
        try:
            return _json_safe(json.loads(text), text)
        except (ValueError, RecursionError):
            pass
    try:
        return _json_safe(ast.literal_eval(text), text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
