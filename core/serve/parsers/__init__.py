"""Server-side parsers of chat outputs: tool calls and reasoning, chosen by name.

One parser per file (``hermes``, ``qwen3_coder``, ``qwen3`` reasoning), each with a
whole-text ``parse`` and an incremental ``stream`` over text deltas whose pieces add
up to the whole-text parse whatever the chunking; ``registry.py`` maps the names
``kvrunner serve`` takes to them and ``chat_output.py`` chains the reasoning parser
into the tool-call parser for one choice.
"""
