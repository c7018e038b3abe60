"""``kvrunner serve``: the HTTP front of an :class:`~kvrunner.AsyncLLM`.

OpenAI-compatible routes, the RL control API in SGLang's shape, vLLM-shaped sleep and
pause routes, and ``/metrics``; docs/serving.md lists every route with its JSON. Needs
the ``serve`` extra (``pip install 'kvrunner[serve]'``: fastapi, uvicorn,
prometheus-client, jinja2, and the ``openai`` client); the rest of kvrunner imports
without it.
"""

from kvrunner.serve.app import build_app
from kvrunner.serve.settings import ServeSettings

__all__ = ["ServeSettings", "build_app"]
