"""The structured-output constraint of a request body, whichever field the client used.

vLLM's routes take it as OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema`` with ``json_schema.schema``, ``structural_tag``), vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
``structural_tag``) or vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``, and a chat request's ``tool_choice``
"required" or a named function (the tools' schema, serve/tool_choice.py); SGLang's
``sampling_params`` as ``json_schema``, ``regex``, ``ebnf`` or ``structural_tag``.
Each becomes one
:class:`~kvrunner.structured_outputs.StructuredOutputsParams`, parsed here (no tokenizer
needed) so that a schema, pattern or grammar that does not parse is a 400 naming the
client's field and the parser's complaint before the request reaches the engine. A
body that constrains the output through two fields is a 400 naming both.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvrunner.engine.grammar_compiler import parse_constraint
from kvrunner.errors import RequestError
from kvrunner.serve.errors import APIError
from kvrunner.serve.openai_protocol import ChatCompletionRequest
from kvrunner.serve.tool_choice import forced_schema
from kvrunner.structured_outputs import StructuredOutputsParams

_ENGINE_NAME = re.compile(r"SamplingParams\.structured_outputs(\.\w+)?")

#: vLLM's older per-constraint fields -> the ``structured_outputs`` field each sets
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
#: the client's name for the field that constrains the output, and the constraint
#: (None: the body sets none)
Constraint = tuple[str, StructuredOutputsParams | None]
#: SGLang's ``sampling_params`` constraint fields -> the ``structured_outputs`` field
SGLANG = {"json_schema": "json", "regex": "regex", "ebnf": "grammar",
          "structural_tag": "structural_tag"}


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as ``structured_outputs`` fields (None: ``text``)."""
    fields = value.model_dump() if hasattr(value, "model_dump") else dict(value)
    kind = fields.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fields.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if schema is None:
            raise APIError(400, "response_format of type json_schema needs "
                           "json_schema.schema, the JSON schema to hold the output to",
                           param="response_format.json_schema")
        if not isinstance(schema, dict | bool):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema "
                           f"(an object), got {type(schema).__name__}",
                           param="response_format.json_schema.schema")
        return {"json": json.dumps(schema)}
    return {"structural_tag": json.dumps(fields)}  # xgrammar reads the tag as given


def _constraint(sources: list[tuple[str, dict[str, Any]]]) -> Constraint:
    """The one source's params, parsed; a 400 naming the client's field otherwise."""
    if len(sources) > 1:
        names = ", ".join(name for name, _ in sources)
        raise APIError(400, f"the output may be constrained by one field only; the request "
                       f"sets {names}", param=sources[1][0])
    if not sources:
        return "structured_outputs", None
    name, fields = sources[0]
    try:
        params = StructuredOutputsParams.of(fields)
        parse_constraint(params)
    except RequestError as e:
        # name the field as the client wrote it: ``structured_outputs.json`` keeps its
        # sub-field, a one-constraint field (``guided_regex``) is named alone
        def label(match: re.Match) -> str:
            return name + (match.group(1) or "") if name == "structured_outputs" else name

        raise APIError(400, _ENGINE_NAME.sub(label, str(e)), param=name) from None
    return name, params


def vllm_constraint(body: Any) -> Constraint:
    """The constraint of a vLLM-family body (completions, chat completions, the
    ``sampling_params`` of ``/inference/v1/generate``), as the ``structured_outputs``
    field of its ``SamplingParams`` (see :data:`Constraint`)."""
    sources: list[tuple[str, dict[str, Any]]] = []
    if isinstance(body, ChatCompletionRequest):
        schema = forced_schema(body)
        if schema is not None:
            sources.append(("tool_choice", {"json": json.dumps(schema)}))
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        fields = _response_format(response_format)
        if fields is not None:
            sources.append(("response_format", fields))
    asked = getattr(body, "structured_outputs", None)
    if asked:
        sources.append(("structured_outputs", asked))
    for name, field in GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            sources.append((name, {field: value}))
    return _constraint(sources)


def sglang_constraint(sampling: Any, *, prefix: str = "sampling_params.") -> Constraint:
    """The constraint of SGLang's ``sampling_params`` (``json_schema``, ``regex``,
    ``ebnf``, ``structural_tag``), as the ``structured_outputs`` field of its
    ``SamplingParams``."""
    sources = [(prefix + name, {field: getattr(sampling, name)})
               for name, field in SGLANG.items() if getattr(sampling, name) is not None]
    return _constraint(sources)
