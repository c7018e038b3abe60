"""The checkpoint's chat template: messages to the prompt text the model was tuned on.

Read from the checkpoint directory as transformers writes it: ``chat_template.jinja``,
or the ``chat_template`` key of ``tokenizer_config.json`` (a string, or a list of named
templates of which ``default`` is used). Rendered with jinja2's sandbox, as
transformers does, so a template cannot reach Python, and with what the templates
published with checkpoints rely on from transformers' environment: ``{% break %}`` and
``{% continue %}``, ``raise_exception(message)``, ``strftime_now(format)``, and a
``tojson`` filter that writes plain JSON (non-ASCII kept, nothing HTML-escaped; the
``indent``, ``separators`` and ``sort_keys`` options of ``json.dumps``).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from kvrunner.errors import CheckpointError


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, *, special: dict[str, str], origin: Path) -> None:
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:  # pragma: no cover - jinja2 comes with the serve extra
            raise CheckpointError(origin, "rendering its chat template needs jinja2: "
                                  "pip install 'kvrunner[serve]'") from e
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        # jinja2's own tojson escapes <, >, & and ' for HTML, which a prompt must not see
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise CheckpointError(origin, f"the chat template does not compile: {e}") from e
        #: the special tokens' texts the template may name (``eos_token`` ...)
        self.special = special
        self.origin = origin

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
               **variables: Any) -> str:
        """The prompt text; ValueError (the template's own ``raise_exception``, or a
        template fault) when the messages do not fit it. ``variables`` are the
        template's other inputs: ``tools``, and a request's ``chat_template_kwargs``
        (Qwen3's ``enable_thinking``)."""
        from jinja2 import TemplateError

        try:
            return self._template.render(**{**variables, **self.special},
                                         messages=messages,
                                         add_generation_prompt=add_generation_prompt)
        except TemplateError as e:
            raise ValueError(f"the chat template failed on these messages: {e}") from e


def _raise(message: str) -> None:
    raise ValueError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...} as some configs write it
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(model_dir: Path) -> ChatTemplate | None:
    """The checkpoint's template, or None when it has none."""
    config_path = model_dir / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(config_path, f"not valid JSON: {e}") from e
    source: Any = None
    origin = config_path
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        source, origin = jinja_file.read_text(), jinja_file
    else:
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise CheckpointError(origin, f"chat_template must be a string, got "
                              f"{type(source).__name__}")
    special = {k: t for k in ("bos_token", "eos_token", "pad_token", "unk_token")
               if (t := _token_text(config.get(k))) is not None}
    return ChatTemplate(source, special=special, origin=origin)
