"""Assembling the FastAPI app around one :class:`~kvrunner.AsyncLLM`.

``build_app`` is the only place that knows every route: the OpenAI-compatible ones, the
SGLang-shaped RL control API, the vLLM-shaped sleep/pause routes, health and
``/metrics``. Each route reads what it needs from :class:`ServerState` (on
``app.state.server``), so the routes hold no module-level globals and two apps in one
process (tests) do not share anything.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import attrs
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from kvrunner.prompts import prompt_token_ids
from kvrunner.serve.auth import BearerAuth
from kvrunner.serve.chat_template import ChatTemplate, load_chat_template
from kvrunner.serve.errors import APIError, install_error_handlers
from kvrunner.serve.metrics import make_registry
from kvrunner.serve.settings import ServeSettings
from kvrunner.serve.shutdown import Admission, GracefulShutdown


@attrs.define(eq=False)
class ServerState:
    """What every route of one app shares."""

    engine: Any
    settings: ServeSettings
    #: the name clients pass as ``model``
    model_name: str
    #: the checkpoint directory (for /get_model_info and the chat template)
    model_path: Path | None
    admission: Admission
    shutdown: GracefulShutdown
    metrics: CollectorRegistry
    chat_template: ChatTemplate | None

    def check_model(self, name: str | None) -> None:
        """A 404 naming ``model`` unless it is the served model (None: not given)."""
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} is not served here; this server "
                           f"serves {self.model_name!r}", param="model")

    @property
    def max_model_len(self) -> int:
        return int(self.engine.config.scheduler.max_model_len)

    def token_ids(self, prompt: str | list[int], *, param: str) -> list[int]:
        """A prompt's token ids; a 400 naming ``param`` for text without a tokenizer."""
        try:
            return prompt_token_ids(prompt, 0, self.engine.tokenizer)
        except ValueError as e:
            raise APIError(400, str(e).replace("request 0: ", ""), param=param) from None

    def decode(self, token_ids: list[int]) -> str:
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(token_ids, skip_special_tokens=True) if tokenizer else ""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def model_directory(engine: Any) -> Path | None:
    """The checkpoint directory the engine loaded (embedded names resolved)."""
    from kvrunner.runner.setup import resolve_model_path

    try:
        return resolve_model_path(str(engine.config.model))
    except Exception:  # a model given some other way: no template, no path to show
        return None


def build_app(engine: Any, settings: ServeSettings, *, model_path: Path | None = None
              ) -> FastAPI:
    """The HTTP app serving ``engine`` (an ``AsyncLLM``) with ``settings``."""
    from kvrunner.serve import (
        control_routes,
        generate_routes,
        info_routes,
        metrics,
        openai_routes,
        vllm_routes,
        weight_routes,
    )

    path = model_path if model_path is not None else model_directory(engine)
    admission = Admission()
    app = FastAPI(title="kvrunner", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = ServerState(
        engine=engine,
        settings=settings,
        model_name=settings.served_model_name or str(engine.model_name),
        model_path=path,
        admission=admission,
        shutdown=GracefulShutdown(engine, admission, mode=settings.shutdown_mode,
                                  drain_timeout_s=settings.drain_timeout_s),
        metrics=make_registry(engine),
        chat_template=load_chat_template(path) if path is not None else None,
    )
    install_error_handlers(app)
    for module in (openai_routes, generate_routes, control_routes, vllm_routes, weight_routes,
                   info_routes, metrics):
        app.include_router(module.router)
    if settings.api_key is not None:
        app.add_middleware(BearerAuth, api_key=settings.api_key)
    return app
