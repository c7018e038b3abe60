"""Assembling the FastAPI app around one :class:`~kvrunner.AsyncLLM`.

``build_app`` is the only place that knows every route: the OpenAI-compatible ones, the
SGLang-shaped RL control API, the vLLM-shaped sleep/pause routes, health and
``/metrics``. Each route reads what it needs from the app's
:class:`~kvrunner.serve.state.ServerState`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI

from kvrunner.serve import (
    checker_routes,
    collective_rpc_routes,
    control_routes,
    generate_routes,
    info_routes,
    load_routes,
    metrics,
    openai_routes,
    token_routes,
    vllm_routes,
    weight_routes,
    weight_transfer_routes,
)
from kvrunner.serve.auth import BearerAuth
from kvrunner.serve.chat_template import load_chat_template
from kvrunner.serve.errors import install_error_handlers
from kvrunner.serve.metrics import make_registry
from kvrunner.serve.settings import ServeSettings
from kvrunner.serve.shutdown import Admission, GracefulShutdown
from kvrunner.serve.state import ServerState, model_directory
from kvrunner.serve.tokenization import ServerTokenizer

if TYPE_CHECKING:
    from kvrunner.async_llm import AsyncLLM


def build_app(engine: AsyncLLM, settings: ServeSettings, *, model_path: Path | None = None
              ) -> FastAPI:
    """The HTTP app serving ``engine`` with ``settings``."""
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
        tokens=None if engine.tokenizer is None else ServerTokenizer(
            engine.tokenizer, max_model_len=int(engine.config.scheduler.max_model_len)),
    )
    install_error_handlers(app)
    for module in (openai_routes, token_routes, generate_routes, control_routes, vllm_routes,
                   weight_routes, weight_transfer_routes, collective_rpc_routes,
                   checker_routes, info_routes, load_routes, metrics):
        app.include_router(module.router)
    if settings.api_key is not None:
        app.add_middleware(BearerAuth, api_key=settings.api_key)
    return app
