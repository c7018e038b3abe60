"""A request's structured-output constraint as an xgrammar grammar, compiled for the model.

:func:`parse_constraint` reads a :class:`~kvrunner.structured_outputs.
StructuredOutputsParams` into an ``xgrammar.Grammar`` (no tokenizer needed: the server
and ``LLM.generate`` call it to refuse a bad schema, pattern or grammar before the
request reaches the engine). :class:`GrammarCompiler` compiles that grammar against the
model's vocabulary (an ``xgrammar.TokenizerInfo`` built once from the engine's
tokenizer, over the model's full vocabulary width: ids past the tokenizer's are never
allowed), caching compiled grammars by their text, as vLLM's xgrammar backend does. The
engine calls it from the threads of its compile pool (``engine/grammar_compiles.py``),
as vLLM does: xgrammar's compiler and its cache are safe to share between threads.

How each constraint reads, as in vLLM: ``json`` is the schema, ``json_object`` the
schema ``{"type": "object"}``, ``choice`` the EBNF alternation of the strings as
literals, ``grammar`` EBNF when it holds ``::=`` and Lark otherwise, ``structural_tag``
xgrammar's structural tag (its older ``structures`` / ``triggers`` form too).

xgrammar is imported on first use: an engine whose requests never ask for a
constraint never loads it, and one without it installed refuses such a request by name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from kvrunner.errors import RequestError
from kvrunner.structured_outputs import StructuredOutputsParams

#: xgrammar's C++ errors start with a time and a source position the client cannot use
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def xgrammar() -> Any:
    """The ``xgrammar`` module; a ``RequestError`` saying how to install it if absent."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise RequestError(
            "SamplingParams.structured_outputs needs the xgrammar package, which is not "
            "installed: pip install 'kvrunner[structured]'"
        ) from None
    return xgr


def choice_ebnf(choices: Iterable[str]) -> str:
    """An EBNF grammar whose only sentences are ``choices``."""
    return "root ::= " + " | ".join(_literal(c) for c in choices)


def _literal(text: str) -> str:
    """``text`` as an EBNF string literal."""
    escaped = []
    for ch in text:
        if ch in '"\\':
            escaped.append("\\" + ch)
        elif ch == "\n":
            escaped.append("\\n")
        elif ch == "\r":
            escaped.append("\\r")
        elif ch == "\t":
            escaped.append("\\t")
        elif ord(ch) < 0x20:
            escaped.append(f"\\x{ord(ch):02x}")
        else:
            escaped.append(ch)
    return '"' + "".join(escaped) + '"'


def parse_constraint(params: StructuredOutputsParams, *, name: str = "") -> Any:
    """``params``' constraint as an ``xgrammar.Grammar``.

    :param name: what the error names the request as (``"request 3: "``).
    :raises RequestError: naming ``SamplingParams.structured_outputs.<field>`` and the
        parser's complaint, for a schema, pattern or grammar xgrammar cannot read.
    """
    xgr = xgrammar()
    kind = params.kind
    whitespace = not params.disable_any_whitespace
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(params.json, any_whitespace=whitespace)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        if kind == "grammar":
            if "::=" in params.grammar:
                return xgr.Grammar.from_ebnf(params.grammar)
            return xgr.Grammar.from_lark(params.grammar)
        tag = json.loads(params.structural_tag)
        if isinstance(tag, dict) and "structures" in tag:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                           end=s["end"]) for s in tag["structures"]]
            return xgr.Grammar.from_structural_tag(items, tag["triggers"])
        return xgr.Grammar.from_structural_tag(params.structural_tag)
    except Exception as e:  # xgrammar raises RuntimeError, ValueError, KeyError, its own
        message = _NATIVE_PREFIX.sub("", str(e).strip()) or type(e).__name__
        raise RequestError(
            f"{name}SamplingParams.structured_outputs.{kind} could not be parsed: {message}"
        ) from None


class GrammarCompiler:
    """Compiles constraints against one model's vocabulary (see the module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        """:param tokenizer: the engine's ``tokenizers.Tokenizer``.
        :param vocab_size: the width of the model's logits (at least the tokenizer's).
        :param eos_token_ids: the model's EOS ids: a complete grammar's stop tokens."""
        xgr = xgrammar()
        from transformers import PreTrainedTokenizerFast  # xgrammar's own dependency

        info = xgr.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_object=tokenizer),
            vocab_size=vocab_size,
            stop_token_ids=sorted(eos_token_ids) or None,
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)

    def compile(self, params: StructuredOutputsParams, *, name: str = "") -> Any:
        """``params``' constraint compiled for this vocabulary (an
        ``xgrammar.CompiledGrammar``); raises as :func:`parse_constraint`."""
        grammar = parse_constraint(params, name=name)
        try:
            return self._compiler.compile_grammar(grammar)
        except Exception as e:
            message = _NATIVE_PREFIX.sub("", str(e).strip()) or type(e).__name__
            raise RequestError(
                f"{name}SamplingParams.structured_outputs.{params.kind} could not be "
                f"compiled: {message}"
            ) from None
