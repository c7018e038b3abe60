"""What every route of one HTTP app shares: :class:`ServerState`, on ``app.state.server``.

The routes read the engine, the settings and the served model's name from it, so
they hold no module-level globals and two apps in one process (tests) share nothing.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from prometheus_client import CollectorRegistry

from kvrunner.prompts import prompt_token_ids
from kvrunner.runner.setup import resolve_model_path
from kvrunner.serve.chat_template import ChatTemplate
from kvrunner.serve.errors import APIError
from kvrunner.serve.settings import ServeSettings
from kvrunner.serve.shutdown import Admission, GracefulShutdown
from kvrunner.serve.tokenization import ServerTokenizer

if TYPE_CHECKING:
    from kvrunner.async_llm import AsyncLLM


@attrs.define(eq=False)
class ServerState:
    """What every route of one app shares."""

    engine: AsyncLLM
    settings: ServeSettings
    #: the name clients pass as ``model``
    model_name: str
    #: the checkpoint directory (for /get_model_info and the chat template)
    model_path: Path | None
    admission: Admission
    shutdown: GracefulShutdown
    metrics: CollectorRegistry
    chat_template: ChatTemplate | None
    #: the tokenizer's work off the event loop; None for a model without a tokenizer
    tokens: ServerTokenizer | None
    #: how the trainer of vLLM's weight transfer packs its broadcasts
    #: (``weight_transfer_routes.Packing``), once ``/init_weight_transfer_engine`` joined
    weight_transfer: Any = None

    def check_model(self, name: str | None) -> None:
        """A 404 naming ``model`` unless it is the served model (None: not given)."""
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} is not served here; this server "
                           f"serves {self.model_name!r}", param="model")

    @property
    def max_model_len(self) -> int:
        return int(self.engine.config.scheduler.max_model_len)

    @property
    def records_routes(self) -> bool:
        """The engine records every token's routed experts
        (``--enable-return-routed-experts``), so requests may get them."""
        return bool(self.engine.config.enable_return_routed_experts)

    async def prompt_ids(self, prompt: str | list[int], *, param: str,
                         add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids (text tokenised off the event loop, refused first if it
        cannot fit: :class:`~kvrunner.serve.tokenization.ServerTokenizer`); a 400
        naming ``param`` for text without a tokenizer."""
        if isinstance(prompt, str) and self.tokens is not None:
            return await self.tokens.prompt_ids(prompt, param=param,
                                                add_special_tokens=add_special_tokens)
        try:
            return prompt_token_ids(prompt, 0, None)
        except ValueError as e:
            raise APIError(400, str(e).replace("request 0: ", ""), param=param) from None

    def token_text(self, token_id: int, *, skip_special_tokens: bool = True) -> str:
        """One token's text as ``decode([token_id])`` gives it ("" without a tokenizer)."""
        if self.tokens is None:
            return ""
        return self.tokens.token_text(token_id, skip_special_tokens=skip_special_tokens)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def model_directory(engine: AsyncLLM) -> Path | None:
    """The checkpoint directory the engine loaded (embedded names resolved)."""
    try:
        return resolve_model_path(str(engine.config.model))
    except Exception:  # a model given some other way: no template, no path to show
        return None
