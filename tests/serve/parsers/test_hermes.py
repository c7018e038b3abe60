"""The ``hermes`` tool-call parser on the outputs its format defines: JSON calls in
``<tool_call>`` blocks, parsed as vLLM's ``hermes`` parser does."""

from __future__ import annotations

import json

from parse_kit import plain

from kvrunner.serve.parsers.hermes import HermesToolParser

parse = HermesToolParser().parse


def test_text_without_a_call_is_all_content() -> None:
    assert plain(parse("It is sunny in Paris.")) == ("It is sunny in Paris.", None, [])
    assert plain(parse("")) == (None, None, [])


def test_a_call_after_text_gives_the_text_as_content_and_arguments_as_json_text() -> None:
    text = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city":"Paris","days":3}}\n</tool_call>')
    # the arguments are written back as json.dumps writes them, as vLLM does
    assert plain(parse(text)) == ("Let me look that up.\n", None,
                                  [("get_weather", '{"city": "Paris", "days": 3}')])


def test_several_calls_in_order_and_no_content_before_them_is_none() -> None:
    text = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')
    assert plain(parse(text)) == (None, None, [("a", '{"x": 1}'), ("b", "{}")])


def test_each_call_has_its_own_id() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "a", "arguments": {}}</tool_call>')
    ids = [call.id for call in parse(text).calls]
    assert len(set(ids)) == 2 and all(i.startswith("chatcmpl-tool-") for i in ids)


def test_malformed_json_leaves_the_whole_output_as_content() -> None:
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    assert plain(parse(text)) == (text, None, [])


def test_a_block_without_name_or_arguments_is_no_call() -> None:
    for body in ('{"arguments": {}}', '{"name": "f"}', '["f", {}]', '{"name": 3, "arguments": {}}'):
        text = f"<tool_call>{body}</tool_call>"
        assert plain(parse(text)) == (text, None, []), body


def test_the_last_block_may_be_left_open_at_the_end_of_the_output() -> None:
    text = 'x<tool_call>\n{"name": "f", "arguments": {"q": "a"}}\n'
    assert plain(parse(text)) == ("x", None, [("f", '{"q": "a"}')])


def test_non_ascii_arguments_stay_as_written() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"town": "Zürich"}}</tool_call>'
    (call,) = parse(text).calls
    assert call.arguments == '{"town": "Zürich"}'
    assert json.loads(call.arguments) == {"town": "Zürich"}


def test_a_malformed_block_among_calls_is_dropped_and_text_after_the_calls_too() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": oops}</tool_call>\nDone.')
    assert plain(parse(text)) == (None, None, [("a", "{}")])
