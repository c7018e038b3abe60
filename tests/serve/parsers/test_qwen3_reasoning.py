"""The ``qwen3`` reasoning parser on Qwen3's ``<think>`` blocks, as vLLM's ``qwen3``
reasoning parser splits them."""

from __future__ import annotations

from parse_kit import plain

from kvrunner.serve.parsers.qwen3_reasoning import Qwen3ReasoningParser

parse = Qwen3ReasoningParser().parse


def test_reasoning_the_model_opens_itself_is_split_from_the_answer() -> None:
    assert plain(parse("<think>\nTwo and two.\n</think>\n\nFour.")) == (
        "\n\nFour.", "\nTwo and two.\n", [])


def test_reasoning_opened_by_the_template_ends_at_the_closing_tag() -> None:
    assert plain(parse("Two and two.</think>Four.")) == ("Four.", "Two and two.", [])


def test_without_the_closing_tag_all_of_the_output_is_reasoning() -> None:
    assert plain(parse("<think>\nStill thinking")) == (None, "\nStill thinking", [])


def test_an_answer_that_is_empty_is_none() -> None:
    assert plain(parse("<think>done</think>")) == (None, "done", [])


def test_with_thinking_off_the_whole_output_is_content() -> None:
    off = Qwen3ReasoningParser(enable_thinking=False).parse
    assert plain(off("Four.")) == ("Four.", None, [])
    assert plain(off("a</think>b")) == ("a</think>b", None, [])


def test_a_call_opened_while_thinking_ends_the_reasoning() -> None:
    text = "I should book.\n<tool_call>\n<function=book>\n</function>\n</tool_call>"
    assert plain(parse(text)) == (
        "<tool_call>\n<function=book>\n</function>\n</tool_call>", "I should book.\n", [])


def test_a_tool_call_tag_mentioned_while_thinking_does_not_end_it() -> None:
    text = 'Use <tool_call>{"name": ...} blocks.'
    assert plain(parse(text)) == (None, text, [])
