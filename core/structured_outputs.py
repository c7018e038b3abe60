"""A request's structured-output constraint, shaped like vLLM's ``StructuredOutputsParams``.

One constraint per request, exactly one of: ``json`` (a JSON schema, as text or a
mapping), ``json_object`` (any JSON object), ``regex``, ``choice`` (the output is one
of these strings), ``grammar`` (an EBNF grammar in xgrammar's GBNF dialect, or a Lark
grammar: text holding ``::=`` is read as EBNF, any other as Lark, vLLM's rule) or
``structural_tag`` (xgrammar's structural tag as JSON text, the current form or the
older ``{"structures": [...], "triggers": [...]}``). ``disable_any_whitespace`` makes a
JSON constraint allow no free whitespace between its tokens.

The fields are checked for their types and for naming exactly one constraint when
the object is built, raising :class:`~kvrunner.errors.RequestError` naming
``SamplingParams.structured_outputs.<field>``. Whether the schema, pattern or grammar
itself parses is checked up front by ``LLM.generate`` and the server (the same error,
before anything is queued) and again by the engine's compile
(``engine/grammar_compiles.py``), which ends a request it cannot compile with finish
reason ``"error"`` naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from kvrunner.errors import RequestError

#: the constraint fields, of which a request sets exactly one
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")

_PREFIX = "SamplingParams.structured_outputs"


def _json_text(value: Any) -> str | None:
    """A JSON schema given as text or as a mapping, as JSON text."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        try:
            return json.dumps(value)
        except (TypeError, ValueError) as e:
            raise RequestError(f"{_PREFIX}.json is not JSON-serialisable: {e}") from None
    if not isinstance(value, str):
        raise RequestError(
            f"{_PREFIX}.json must be a JSON schema (text or a mapping), got "
            f"{type(value).__name__}"
        )
    try:
        json.loads(value)
    except ValueError as e:
        raise RequestError(f"{_PREFIX}.json is not valid JSON: {e}") from None
    return value


def _text(name: str):
    def convert(value: Any) -> str | None:
        if value is None:
            return None
        if isinstance(value, Mapping) and name == "structural_tag":
            return json.dumps(value)
        if not isinstance(value, str) or not value:
            raise RequestError(f"{_PREFIX}.{name} must be a non-empty string, got {value!r}")
        return value

    return convert


def _choices(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str | bytes | Mapping) or not hasattr(value, "__iter__"):
        raise RequestError(f"{_PREFIX}.choice must be a list of strings, got {value!r}")
    choices = tuple(value)
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise RequestError(
            f"{_PREFIX}.choice must be a non-empty list of non-empty strings, got {value!r}"
        )
    return choices


def _bool(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise RequestError(f"{_PREFIX}.{attribute.name} must be True or False, got {value!r}")


@attrs.frozen(kw_only=True)
class StructuredOutputsParams:
    """The output a request must produce (see the module docstring); exactly one of the
    constraint fields is set."""

    #: a JSON schema, as JSON text (a mapping given is serialised)
    json: str | None = attrs.field(default=None, converter=_json_text)
    #: any JSON object
    json_object: bool = attrs.field(default=False, validator=_bool)
    regex: str | None = attrs.field(default=None, converter=_text("regex"))
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_choices)
    #: an EBNF (xgrammar's GBNF, holding ``::=``) or a Lark grammar
    grammar: str | None = attrs.field(default=None, converter=_text("grammar"))
    #: xgrammar's structural tag, as JSON text (a mapping given is serialised)
    structural_tag: str | None = attrs.field(default=None, converter=_text("structural_tag"))
    #: a JSON constraint allows no whitespace beyond what the schema needs
    disable_any_whitespace: bool = attrs.field(default=False, validator=_bool)

    def __attrs_post_init__(self) -> None:
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise RequestError(
                f"{_PREFIX} must set exactly one of {', '.join(KINDS)}; got "
                f"{'none' if not kinds else ', '.join(kinds)}"
            )

    @property
    def kind(self) -> str:
        """The constraint's field name (one of :data:`KINDS`)."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def of(cls, value: Any) -> StructuredOutputsParams | None:
        """``value`` as params: None, params, or a mapping of their fields (vLLM's JSON
        body); an unknown key is refused by name."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise RequestError(
                f"{_PREFIX} must be StructuredOutputsParams or a mapping of its fields, got "
                f"{type(value).__name__}"
            )
        known = set(attrs.fields_dict(cls))
        unknown = [k for k in value if k not in known]
        if unknown:
            raise RequestError(
                f"{_PREFIX} has no field {unknown[0]!r} (fields: {', '.join(sorted(known))})"
            )
        # vLLM's JSON body writes unset fields as null (and json_object as false)
        return cls(**{k: v for k, v in value.items() if v is not None})
