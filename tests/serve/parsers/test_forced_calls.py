"""The outputs of a forced ``tool_choice``: a named function's output is its call's
arguments; "required"'s JSON array of ``{"name", "parameters"}`` is one call per
element, its arguments the text of its parameters, however the JSON is spaced."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from parse_kit import plain, streamed

from kvrunner.serve.parsers.named_call import NamedCallParser
from kvrunner.serve.parsers.required_calls import RequiredCallsParser

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-99, 99),
                     st.floats(allow_nan=False, allow_infinity=False),
                     st.text(alphabet='ab"\\]}{[,: é\n', max_size=6))
JSON = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(alphabet='xy"}', max_size=3), inner,
                                                 max_size=3)), max_leaves=8)
NAMES = st.text(alphabet='fgé_"\\', min_size=1, max_size=5)
#: how a model may space the JSON: indent, separators, whether ``name`` comes first
LAYOUTS = st.tuples(st.sampled_from([None, 0, 2, "\t"]),
                    st.sampled_from([(",", ":"), (", ", ": "), (" ,\r\n", " :\t")]),
                    st.booleans(), st.booleans())


def _written(calls: list[tuple[str, object]], layout: tuple) -> str:
    indent, separators, name_first, ascii_only = layout
    elements = [{"name": n, "parameters": p} if name_first else {"parameters": p, "name": n}
                for n, p in calls]
    return json.dumps(elements, indent=indent, separators=separators, ensure_ascii=ascii_only)


@settings(max_examples=300)
@given(st.lists(st.tuples(NAMES, JSON), min_size=1, max_size=3), LAYOUTS)
def test_each_element_of_the_array_is_a_call_with_its_parameters(calls, layout) -> None:
    _, _, found = plain(RequiredCallsParser().parse(_written(calls, layout)))
    assert [name for name, _ in found] == [name for name, _ in calls]
    assert [json.loads(arguments) for _, arguments in found] == [p for _, p in calls]


def test_the_arguments_are_the_parameters_as_the_model_wrote_them() -> None:
    text = '[ {"name": "f", "parameters": {"n" :\t1,\n"s": "}"} } ]'
    assert plain(RequiredCallsParser().parse(text)) == (
        None, None, [("f", '{"n" :\t1,\n"s": "}"}')])


def test_an_output_cut_short_gives_the_calls_begun_the_last_one_cut() -> None:
    text = '[{"name": "f", "parameters": {"n": 1}}, {"name": "g", "parameters": {"s": "ab'
    assert plain(RequiredCallsParser().parse(text))[2] == [("f", '{"n": 1}'), ("g", '{"s": "ab')]
    # a name not yet closed, or parameters not yet begun, is no call yet
    assert plain(RequiredCallsParser().parse('[{"name": "f", "parameters": '))[2] == []
    assert plain(RequiredCallsParser().parse('[{"parameters": {"n": 1}, "name": "f'))[2] == []


def test_an_element_without_a_name_string_or_parameters_is_no_call() -> None:
    text = '[{"name": "f"}, {"parameters": {}}, {"name": 3, "parameters": {}}, 5, "x",' \
           ' {"name": "g", "parameters": {}, "name": "h"}]'
    assert plain(RequiredCallsParser().parse(text))[2] == [("g", "{}")]


def test_a_stream_sends_a_call_once_its_name_and_parameters_have_begun() -> None:
    stream = RequiredCallsParser().stream()
    assert stream.feed('[{"name": "f", "parameters"') == []
    (first,) = stream.feed(': {"n"')
    assert (first.call.index, first.call.name, first.call.arguments) == (0, "f", '{"n"')
    assert first.call.id.startswith("chatcmpl-tool-")
    (more,) = stream.feed(": 1}}, {")
    assert (more.call.index, more.call.id, more.call.name, more.call.arguments) == \
        (0, None, None, ": 1}")


def test_a_named_functions_output_is_its_calls_arguments() -> None:
    parser = NamedCallParser("get_weather")
    assert plain(parser.parse('{"city": "Oslo"}')) == (
        None, None, [("get_weather", '{"city": "Oslo"}')])
    assert plain(parser.parse(" \n")) == (None, None, [])  # blank: no call, as vLLM
    assert plain(streamed(parser, [" ", "\n", '{"c', 'ity": 1}'])) == (
        None, None, [("get_weather", ' \n{"city": 1}')])
