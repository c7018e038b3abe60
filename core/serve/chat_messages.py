"""Chat messages to prompt text: OpenAI's message objects rendered with a chat template.

The template is the checkpoint's, or one a request brings (compiled in the same
sandbox). Messages reach it as transformers hands them to a template: ``content``
(null for an assistant turn that only calls tools), ``tool_calls`` with their
arguments parsed from JSON, ``tool_call_id``, ``reasoning_content``; ``tools`` and a
request's ``chat_template_kwargs`` (Qwen3's ``enable_thinking``) are the template's
other variables. Image, audio and video parts are refused by name.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from kvrunner.errors import KvrunnerError
from kvrunner.serve.chat_template import ChatTemplate
from kvrunner.serve.errors import APIError
from kvrunner.serve.openai_protocol import ChatMessage, TextPart, Tool
from kvrunner.serve.state import ServerState


def message_dict(m: ChatMessage, index: int) -> dict[str, Any]:
    """One chat message as the templates read it (OpenAI's fields, tool calls with their
    arguments parsed from JSON, as transformers hands them to a template)."""
    if isinstance(m.content, list):
        media = [part.type for part in m.content if not isinstance(part, TextPart)]
        if media:
            raise APIError(400, f"messages.{index}: {media[0]} content is not supported "
                           f"by kvrunner (it serves text models)", param=f"messages.{index}")
        content: Any = "".join(part.text for part in m.content)
    else:
        content = m.content
    message: dict[str, Any] = {"role": m.role, "content": content}
    if m.name:
        message["name"] = m.name
    if m.reasoning_content is not None:
        message["reasoning_content"] = m.reasoning_content
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                raise APIError(400, f"messages.{index}.tool_calls: the arguments of "
                               f"{call.function.name!r} are not JSON",
                               param=f"messages.{index}.tool_calls") from None
            calls.append({"id": call.id, "type": call.type,
                          "function": {"name": call.function.name, "arguments": arguments}})
        message["tool_calls"] = calls
    return message



async def render_messages(state: ServerState, messages: list[ChatMessage], *,
                          tools: list[Tool] | None, add_generation_prompt: bool,
                          template_kwargs: dict[str, Any] | None,
                          template_source: str | None = None) -> str:
    """The prompt text of ``messages``, compiled and rendered off the event loop; a
    400 naming what does not fit."""
    if state.tokens is None:
        raise APIError(400, "the model has no tokenizer, so chat messages cannot be "
                       "tokenized; use /v1/completions with token ids", param="messages")
    template = state.chat_template
    if template_source is not None:
        try:
            template = await state.tokens.run(_compiled, template_source, template)
        except KvrunnerError as e:
            raise APIError(400, str(e), param="chat_template") from None
    if template is None:
        raise APIError(400, f"the model {state.model_name!r} has no chat template (no "
                       f"chat_template in its tokenizer_config.json, no chat_template.jinja); "
                       f"use /v1/completions with a prompt instead", param="messages")
    variables = dict(template_kwargs or {})
    if tools:
        variables["tools"] = [tool.model_dump(exclude_none=True) for tool in tools]
    dicts = [message_dict(m, i) for i, m in enumerate(messages)]
    try:
        return await state.tokens.run(
            partial(template.render, dicts, add_generation_prompt=add_generation_prompt,
                    **variables))
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


def _compiled(source: str, checkpoint: ChatTemplate | None) -> ChatTemplate:
    """A request's own template, with the checkpoint's special tokens."""
    return ChatTemplate(source, special=checkpoint.special if checkpoint else {},
                        origin=Path("<request>"))
