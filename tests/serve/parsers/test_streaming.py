"""Every parser's stream adds up to its whole-text parse, whatever the chunking: one
character per delta, every single cut, and random cuts, over outputs drawn from each
format's own pieces (whole and broken tags, JSON, parameters, text)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from parse_kit import cut, plain, streamed

from kvrunner.serve.parsers.chat_output import ChatOutputParser
from kvrunner.serve.parsers.hermes import HermesToolParser
from kvrunner.serve.parsers.named_call import NamedCallParser
from kvrunner.serve.parsers.parsed import accumulate
from kvrunner.serve.parsers.qwen3_coder import Qwen3CoderToolParser
from kvrunner.serve.parsers.qwen3_reasoning import Qwen3ReasoningParser
from kvrunner.serve.parsers.required_calls import RequiredCallsParser

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"},
                                     "o": {"type": "object"}}}}}]

_TEXT = st.text(alphabet="ab <>/=\n{}\"é", max_size=4)
HERMES_PIECES = ["<tool_call>", "</tool_call>", "<tool_", "call>", "\n",
                 '{"name": "f", "arguments": {"n": 1}}', '{"name": "g", "arguments": {}}',
                 '{"name": "h", "arguments": {"s": "é"}}', '{"name": ', '"arguments": {}}',
                 "Hello ", "<", ">"]
CODER_PIECES = ["<tool_call>", "</tool_call>", "<function=f>", "<function=g>", "<function=",
                "</function>", "<parameter=n>", "<parameter=s>", "<parameter=o>",
                "<parameter=", "</parameter>", "</param", "\n", "12", "x y", '{"k": [1]}',
                "null", "Hi ", ">", "<"]
#: JSON of a list of calls ("required" tool choice), whole and in pieces
CALLS_PIECES = ["[", "]", "{", "}", ",", ":", " ", "\n", '"name"', '"parameters"', '"f"',
                '"g\\u00e9"', '"a\\"b"', '"', "\\", '{"n": 1}', "[1, {}]", "7", "true",
                '"s"', '"]}"', "x"]
#: JSON arguments of a named function's call
NAMED_PIECES = [" ", "\n", "{", "}", '"n"', ":", "1", ",", '"s"']
THINK_PIECES = ["<think>", "</think>", "<thi", "</thi", "<tool_call>", "\n", "  ",
                "<function=f>", "<function", "=", "plan ", "<", "answer"]


def outputs(pieces: list[str]) -> st.SearchStrategy[str]:
    return st.lists(st.one_of(st.sampled_from(pieces), _TEXT), max_size=14).map("".join)


PARSERS = {
    "hermes": (HermesToolParser(TOOLS), HERMES_PIECES),
    "qwen3_coder": (Qwen3CoderToolParser(TOOLS), CODER_PIECES),
    "qwen3": (Qwen3ReasoningParser(), THINK_PIECES),
    "qwen3 off": (Qwen3ReasoningParser(enable_thinking=False), THINK_PIECES),
    "qwen3 + qwen3_coder": (ChatOutputParser(Qwen3ReasoningParser(),
                                             Qwen3CoderToolParser(TOOLS)),
                            THINK_PIECES + CODER_PIECES),
    "qwen3 + hermes": (ChatOutputParser(Qwen3ReasoningParser(), HermesToolParser(TOOLS)),
                       THINK_PIECES + HERMES_PIECES),
    "required": (RequiredCallsParser(), CALLS_PIECES),
    "named": (NamedCallParser("f"), NAMED_PIECES),
}


def check_every_chunking(parser: object, text: str, random_cuts: list[int]) -> None:
    whole = plain(parser.parse(text))
    assert plain(streamed(parser, text)) == whole, "one delta"
    assert plain(streamed(parser, list(text))) == whole, "a character per delta"
    for k in range(1, len(text)):
        assert plain(streamed(parser, cut(text, [k]))) == whole, f"cut at {k}"
    assert plain(streamed(parser, cut(text, random_cuts))) == whole, f"cuts {random_cuts}"


def _case(name: str) -> st.SearchStrategy:
    parser, pieces = PARSERS[name]
    return outputs(pieces).flatmap(lambda text: st.tuples(
        st.just(text), st.lists(st.integers(0, max(len(text), 1)), max_size=8)))


@settings(max_examples=150)
@given(_case("hermes"))
def test_hermes_streams_to_its_whole_text_parse(case: tuple[str, list[int]]) -> None:
    check_every_chunking(PARSERS["hermes"][0], *case)


@settings(max_examples=150)
@given(_case("qwen3_coder"))
def test_qwen3_coder_streams_to_its_whole_text_parse(case: tuple[str, list[int]]) -> None:
    check_every_chunking(PARSERS["qwen3_coder"][0], *case)


@settings(max_examples=150)
@given(_case("qwen3"))
def test_qwen3_reasoning_streams_to_its_whole_text_parse(case: tuple[str, list[int]]) -> None:
    check_every_chunking(PARSERS["qwen3"][0], *case)
    check_every_chunking(PARSERS["qwen3 off"][0], *case)


@settings(max_examples=150)
@given(_case("qwen3 + qwen3_coder"))
def test_reasoning_then_qwen3_coder_streams_to_the_whole_text_parse(
        case: tuple[str, list[int]]) -> None:
    check_every_chunking(PARSERS["qwen3 + qwen3_coder"][0], *case)


@settings(max_examples=150)
@given(_case("qwen3 + hermes"))
def test_reasoning_then_hermes_streams_to_the_whole_text_parse(
        case: tuple[str, list[int]]) -> None:
    check_every_chunking(PARSERS["qwen3 + hermes"][0], *case)


@settings(max_examples=300)
@given(_case("required"))
def test_required_calls_stream_to_the_whole_text_parse(case: tuple[str, list[int]]) -> None:
    check_every_chunking(PARSERS["required"][0], *case)


@settings(max_examples=100)
@given(_case("named"))
def test_a_named_call_streams_to_the_whole_text_parse(case: tuple[str, list[int]]) -> None:
    check_every_chunking(PARSERS["named"][0], *case)


#: outputs a model of each format writes, each checked at every cut
WRITTEN = {
    "hermes": 'Checking.\n<tool_call>\n{"name": "f", "arguments": {"n": 2, "s": "Zürich"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
    "qwen3_coder": "Checking.\n<tool_call>\n<function=f>\n<parameter=n>\n2\n</parameter>\n"
                   "<parameter=o>\n{\"k\": [1, 2]}\n</parameter>\n</function>\n</tool_call>",
    "qwen3 + qwen3_coder": "<think>\nNeed f.\n</think>\n\n<tool_call>\n<function=f>\n"
                           "<parameter=s>\nhi\n</parameter>\n</function>\n</tool_call>",
    "qwen3 + hermes": "<think>\nNeed g.\n</think>\n\nOn it.\n<tool_call>\n"
                      '{"name": "g", "arguments": {}}\n</tool_call>',
    "required": '[\n {"name": "f", "parameters": {"n": 2, "s": "a]}\\"b"}},\n'
                ' {"parameters": [1, {"k": null}], "name": "g"}, {"name":"h","parameters":7}]',
    "named": ' {"n": 2, "s": "Zürich"}',
}
#: outputs at the formats' edges, checked the same way
EDGES = [
    # a call opened while thinking (Qwen3.5), the reasoning never closed
    ("qwen3 + qwen3_coder", "Need f.\n<tool_call>\n<function=f>\n<parameter=n>\n1\n"
                            "</parameter>\n</function>\n</tool_call>"),
    ("qwen3_coder", "<function=f><parameter=n>1</parameter><parameter=n>2</parameter></function>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{bad}'),
    ("qwen3_coder", "Hi <tool_call>\n<function=f\n<parameter=n>1"),
]


def test_outputs_as_models_write_them_stream_to_the_whole_text_parse_at_every_cut() -> None:
    for name, text in WRITTEN.items():
        parser = PARSERS[name][0]
        assert plain(parser.parse(text))[2], name  # they do hold calls
        check_every_chunking(parser, text, list(range(0, len(text), 3)))
    for name, text in EDGES:
        check_every_chunking(PARSERS[name][0], text, list(range(0, len(text), 5)))


def test_a_qwen3_coder_call_streams_its_name_first_then_a_fragment_per_parameter() -> None:
    stream = PARSERS["qwen3_coder"][0].stream()
    text = WRITTEN["qwen3_coder"]
    per_delta = [stream.feed(c) for c in text] + [stream.finish()]
    calls = [piece.call for pieces in per_delta for piece in pieces if piece.call]
    assert [c.name for c in calls] == ["f", None, None, None]
    assert calls[0].id is not None and calls[0].arguments == ""
    assert [c.arguments for c in calls[1:]] == ['{"n": 2', ', "o": {"k": [1, 2]}', "}"]
    assert json.loads("".join(c.arguments for c in calls)) == {"n": 2, "o": {"k": [1, 2]}}
    # the name goes out as soon as its tag closes, before any parameter arrives
    first = next(i for i, pieces in enumerate(per_delta) if any(p.call for p in pieces))
    assert text[:first + 1].endswith("<function=f>")


def test_content_before_a_call_streams_before_the_call_closes() -> None:
    stream = PARSERS["hermes"][0].stream()
    sent = stream.feed("Checking the weather.\n<tool")
    assert accumulate(sent).content == "Checking the weather.\n"  # "<tool" is held back
    assert stream.feed("_call>\n{\"name\": \"g\"") == []
