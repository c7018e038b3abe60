"""What the HTTP server is told at start-up, apart from the engine's own settings."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import attrs

from kvrunner.config import ConfigError

#: the environment variable read when ``--api-key`` is not given
API_KEY_ENV = "KVRUNNER_API_KEY"


def _positive(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"serve: {attribute.name} must be a positive number, got {value!r}")


def _positive_int(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"serve: {attribute.name} must be a positive integer, got {value!r}")


def _choice(*allowed: str):
    def check(_instance: object, attribute: attrs.Attribute, value: object) -> None:
        if value not in allowed:
            raise ConfigError(
                f"serve: {attribute.name} must be one of {list(allowed)}, got {value!r}"
            )

    return check


def _parser(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    from kvrunner.serve.parsers.registry import check_parser

    check_parser(attribute.name, value if value is None else str(value))


def _port(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ConfigError(f"serve: port must be an integer in [0, 65535], got {value!r}")


#: the backends of vLLM's ``--weight-transfer-config`` kvrunner serves
WEIGHT_TRANSFER_BACKENDS = ("nccl", "ipc")

#: the keys each backend's config takes besides ``backend`` (vLLM's
#: ``IPCWeightTransferConfig``: its packing, which the trainer's config shares; the
#: engine reads the form of each update's handles instead), with their checks
_BACKEND_KEYS: dict[str, dict[str, Callable[[object], bool]]] = {
    "nccl": {},
    "ipc": {"packed": lambda v: isinstance(v, bool),
            "packed_buffer_size_bytes": lambda v: (isinstance(v, int)
                                                   and not isinstance(v, bool) and v > 0)},
}


def weight_transfer_backend(text: str) -> str:
    """The backend a ``--weight-transfer-config`` JSON object names (vLLM's
    ``WeightTransferConfig``: ``{"backend": "nccl"}``, ``{"backend": "ipc"}``, the
    latter with vLLM's optional ``packed`` and ``packed_buffer_size_bytes``); anything
    else is refused by name."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"serve: --weight-transfer-config is not JSON: {e}") from None
    if not isinstance(config, dict) or "backend" not in config:
        raise ConfigError(f"serve: --weight-transfer-config must be an object with the key "
                          f"'backend' (nccl: the one key 'backend'; ipc: also 'packed' and "
                          f"'packed_buffer_size_bytes'), got {text!r}")
    backend = config["backend"]
    if backend not in WEIGHT_TRANSFER_BACKENDS:
        raise ConfigError(f"serve: --weight-transfer-config backend must be one of "
                          f"{list(WEIGHT_TRANSFER_BACKENDS)}, got {backend!r}")
    keys = _BACKEND_KEYS[backend]
    for key, value in config.items():
        if key == "backend":
            continue
        if key not in keys:
            allowed = (", ".join(repr(k) for k in ("backend", *keys)) if keys
                       else "the one key 'backend'")
            raise ConfigError(f"serve: --weight-transfer-config for backend {backend!r} takes "
                              f"{allowed}, got {key!r}")
        if not keys[key](value):
            raise ConfigError(f"serve: --weight-transfer-config {key} is {value!r}")
    return backend


@attrs.frozen(kw_only=True)
class ServeSettings:
    """The server's own settings (the engine's are an ``EngineConfig``).

    Secure by default: it listens on the loopback interface only, and the routes that
    can replace the model or stop generation for everyone (weights, memory, pause,
    flush, abort) answer 403 unless ``enable_rl_endpoints``.
    """

    host: str = "127.0.0.1"
    port: int = attrs.field(default=8000, validator=_port)
    #: the Bearer token every route requires; None: no authentication
    api_key: str | None = None
    #: serve the routes that change the engine's weights, memory or schedule
    enable_rl_endpoints: bool = False
    #: vLLM's weight-transfer backend (``--weight-transfer-config``): ``"nccl"`` serves
    #: ``/init_weight_transfer_engine`` and the update routes over a weight-update group
    #: (gloo on a CPU engine), ``"ipc"`` serves them with CUDA IPC handles from a
    #: colocated trainer; None: those routes answer 400 naming the flag
    weight_transfer_backend: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(_choice(*WEIGHT_TRANSFER_BACKENDS)))
    #: the name clients pass as ``model``; None: the model setting as given
    served_model_name: str | None = None
    #: the most samples one request may ask for (``n``): a bound on what one client
    #: can make the server hold
    max_n: int = attrs.field(default=16, validator=_positive)
    #: the most top logprobs one request may ask for per token
    max_logprobs: int = attrs.field(default=20, validator=_positive)
    #: the largest request body read (bytes); a larger one is refused with 413 as soon
    #: as it is known to be larger, before it is parsed
    max_body_bytes: int = attrs.field(default=64 * 1024 * 1024, validator=_positive_int)
    #: on SIGTERM: "abort" ends every request at once (finish reason "abort"), "drain"
    #: lets them finish for up to ``drain_timeout_s`` and then aborts what is left
    shutdown_mode: str = attrs.field(default="abort", validator=_choice("abort", "drain"))
    drain_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    #: the tool-call parser of chat outputs, by vLLM's name (``hermes``, ``qwen3_coder``);
    #: None: calls stay in the text
    tool_call_parser: str | None = attrs.field(default=None, validator=_parser)
    #: parse calls for ``tool_choice="auto"`` (vLLM's ``--enable-auto-tool-choice``);
    #: needs ``tool_call_parser``
    enable_auto_tool_choice: bool = False
    #: the reasoning parser of chat outputs (``qwen3``); None: reasoning stays in the text
    reasoning_parser: str | None = attrs.field(default=None, validator=_parser)
    #: uvicorn's log level
    log_level: str = attrs.field(
        default="warning", validator=_choice("critical", "error", "warning", "info", "debug")
    )

    def __attrs_post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("serve: --enable-auto-tool-choice needs --tool-call-parser "
                              "(the parser that reads the calls out of the output)")

    @classmethod
    def with_env_key(cls, *, api_key: str | None = None, **fields: object) -> ServeSettings:
        """Settings whose ``api_key`` falls back to ``$KVRUNNER_API_KEY``; an empty key is
        refused (it would look like protection and be none)."""
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        if key is not None and not key.strip():
            raise ConfigError(f"serve: the API key (--api-key or ${API_KEY_ENV}) is empty")
        return cls(api_key=key, **fields)
