"""The ``kvrunner`` command: backends, check-backend, generate, make-tiny, rollout, serve."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from kvrunner import __version__
from kvrunner.cli.help import choices_of, field_help
from kvrunner.config import _SECTIONS, ConfigError, EngineConfig
from kvrunner.errors import KvrunnerError, RequestError
from kvrunner.plugin_api.errors import BackendError, BackendHookError

DESCRIPTION = (
    "kvrunner: an LLM inference runtime for RL rollouts with pluggable attention and "
    "cache backends. Every engine setting is a flag (--block-size 32) or a key of the "
    "TOML file given with --config; a flag overrides the file."
)
#: exit status after Ctrl-C, as a shell reports a process ended by SIGINT
EXIT_INTERRUPTED = 130
#: exit status of ``generate`` when a request ended with finish reason "error"
EXIT_REQUEST_FAILED = 1


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field (``--block-size``), plus ``--config FILE.toml``."""
    parser.add_argument("--config", dest="config_file", metavar="FILE.toml",
                        help="TOML file with engine settings (see docs/example.toml); "
                        "flags override it")
    top = parser.add_argument_group("engine")
    for field in attrs.fields(EngineConfig):
        if field.name not in _SECTIONS:
            _add_field_flag(top, field, None)
    for section, klass in _SECTIONS.items():
        group = parser.add_argument_group(f"[{section}]")
        for field in attrs.fields(klass):
            _add_field_flag(group, field, section)


def _add_field_flag(group: Any, field: attrs.Attribute, section: str | None) -> None:
    flag = "--" + field.name.replace("_", "-")
    common = dict(dest=field.name, default=None, help=field_help(field, section))
    if field.type in ("bool", bool):
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
    elif field.name == "capture_sizes":
        group.add_argument(flag, type=_capture_sizes, metavar="N,N,...", **common)
    else:
        kind = {"int": int, "float": float, "str": str}.get(str(field.type).split(" ")[0])
        group.add_argument(flag, type=kind or _int_or_none, choices=choices_of(field), **common)


def _capture_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of batch sizes (like 1,2,4,8)"
        ) from None
    if any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: every batch size must be >= 1")
    return sizes


def _int_or_none(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (or 'none')") from None


_int_or_none.__name__ = "integer"  # argparse names the type in its message


def _config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for f in attrs.fields(EngineConfig) if f.name not in _SECTIONS} | {
        f.name for klass in _SECTIONS.values() for f in attrs.fields(klass)
    }
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def _cmd_backends(args: argparse.Namespace) -> int:
    from kvrunner.plugin_host.plugins import discover_backends

    found = discover_backends()
    if not found:
        print("no backends installed (group kvrunner.backends)")
        return 1
    print(f"{'name':<10} {'distribution':<18} {'version':<9} {'layer types':<34} plugin API")
    for name, backend in sorted(found.items()):
        try:
            factory = backend.load()
            layer_types, api = ", ".join(factory.layer_types), str(factory.plugin_api_version)
            if getattr(factory, "plugin_role", "layers") == "overlap":
                layer_types = "(overlap plugin: backends.overlap)"
        except BackendError as e:
            layer_types, api = "-", f"LOAD ERROR: {e}"
        print(f"{name:<10} {backend.distribution:<18} {backend.version:<9} {layer_types:<34} {api}")
    return 0


def _cmd_check_backend(args: argparse.Namespace) -> int:
    try:
        from kvrunner.testing.conformance.command import check_backend
    except ImportError as e:  # the kit's strategies need hypothesis, an optional extra
        print(f"kvrunner: check-backend needs {e.name}: pip install 'kvrunner[conformance]'",
              file=sys.stderr)
        return 2

    return check_backend(args.name, checks=args.check, examples=args.examples,
                         use_triton=args.triton, overlap=args.overlap,
                         kv_cache_dtype=args.kv_cache_dtype)


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from kvrunner.models.tiny import write_tiny_checkpoint

    target = Path(args.path)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not args.force:
        raise ConfigError(
            f"{target} exists and is not empty; choose another directory, or pass --force "
            f"to write the checkpoint's files into it (replacing files of the same name)"
        )
    path = write_tiny_checkpoint(target, kind=args.kind, seed=args.seed)
    print(f"wrote {args.kind} checkpoint to {path}")
    return 0


def _prompts(args: argparse.Namespace) -> list[str] | list[list[int]]:
    """The prompts as text, or as token-id lists with ``--token-ids``; checked here,
    before any model is loaded."""
    prompts: list[Any] = []
    for index, text in enumerate(args.prompt):
        if not args.token_ids:
            if not text:
                raise RequestError(f"request {index}: the prompt is empty")
            prompts.append(text)
            continue
        try:
            prompts.append([int(t) for t in text.replace(" ", ",").split(",") if t])
        except ValueError:
            raise RequestError(
                f"request {index}: {text!r} is not a comma-separated list of token ids"
            ) from None
        if not prompts[-1]:
            raise RequestError(f"request {index}: the prompt is empty")
    return prompts


def _token_id_list(text: str) -> list[int]:
    """An argparse type: comma-separated token ids (``1,2``)."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of token ids (like 1,2)"
        ) from None


def _print_output(out: Any, prompt: Any, n: int, tokenizer: Any | None) -> None:
    """One sample: a header line (prompt, sample, why it ended), its text (or its
    token ids, for a model without a tokenizer), then with --logprobs one line per
    token: position, id, text, logprob and the top-N."""
    sample = f" [sample {out.sample_index + 1}/{n}]" if n > 1 else ""
    why = f" ({out.stop_reason!r})" if out.stop_reason is not None else ""
    if out.finish_reason == "error":
        why = f" ({out.error})"
    print(f"--- {prompt!r}{sample} -> {out.finish_reason}{why}")
    print(out.text if tokenizer is not None else out.token_ids)
    if out.logprobs is None:
        return
    tops = out.top_logprobs or [None] * len(out.token_ids)
    for position, (token, logprob, top) in enumerate(
        zip(out.token_ids, out.logprobs, tops, strict=True)
    ):
        text = f" {tokenizer.decode([token])!r}" if tokenizer is not None else ""
        line = f"  [{position}] {token}{text} {logprob:.4f}"
        if top:
            line += "  top: " + " | ".join(f"{t} {lp:.4f}" for t, lp in top.items())
        print(line)


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvrunner import SamplingParams
    from kvrunner.prompts import require_tokenizer

    # Everything that can be checked without the model is checked first: a typo
    # should not cost a model load.
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.sample_seed,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        stop_token_ids=args.stop_token_ids,
        stop=args.stop,
        n=args.n,
    )
    prompts = _prompts(args)
    config = EngineConfig.load(args.config_file, **_config_kwargs(args))
    if not args.token_ids:
        require_tokenizer(config, "a text prompt", "pass --token-ids with token-id prompts")
    if params.stop:
        require_tokenizer(config, "--stop", "use --stop-token-ids")
    from kvrunner.engine.llm_engine import group_size
    from kvrunner.llm import LLM

    llm = LLM(config_file=args.config_file, progress=True, **_config_kwargs(args))
    try:
        outs = llm.generate(prompts, params, use_tqdm=True)
        n = group_size(params)  # the samples the engine made of each prompt
        for index, out in enumerate(outs):  # prompt-major: n samples per prompt
            _print_output(out, prompts[index // n], n, llm.tokenizer)
    finally:
        llm.shutdown()
    failed = [out for out in outs if out.finish_reason == "error"]
    if failed:
        print(f"kvrunner: error: {len(failed)} of {len(outs)} request(s) ended in error: "
              f"{failed[0].error}", file=sys.stderr)
        return EXIT_REQUEST_FAILED
    return 0


#: rollout's token-id prompts' length when --token-ids is given without --prompt-len
DEFAULT_PROMPT_LEN = 16


def _cmd_rollout(args: argparse.Namespace) -> int:
    from kvrunner.cli.rollout import run_rollout

    prompt_len = args.prompt_len
    if prompt_len is None and args.token_ids:
        prompt_len = DEFAULT_PROMPT_LEN
    return run_rollout(
        config_file=args.config_file,
        rounds=args.rounds,
        batch=args.batch,
        max_tokens=args.max_tokens,
        config=_config_kwargs(args),
        sleep_level=args.sleep_level,
        update=args.update,
        prompt_len=prompt_len,
        prompt_seed=args.prompt_seed,
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from kvrunner.serve.server import serve_forever
        from kvrunner.serve.settings import ServeSettings, weight_transfer_backend
    except ImportError as e:  # fastapi, uvicorn, prometheus-client: an optional extra
        print(f"kvrunner: serve needs {e.name}: pip install 'kvrunner[serve]'", file=sys.stderr)
        return 2
    settings = ServeSettings.with_env_key(
        host=args.host, port=args.port, api_key=args.api_key,
        enable_rl_endpoints=args.enable_rl_endpoints,
        served_model_name=args.served_model_name, max_n=args.max_n,
        max_logprobs=getattr(args, "max_logprobs", None) or 20, shutdown_mode=args.shutdown_mode,
        drain_timeout_s=args.drain_timeout, log_level=args.log_level,
        max_body_bytes=args.max_body_bytes, tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        weight_transfer_backend=(None if args.weight_transfer_config is None
                                 else weight_transfer_backend(args.weight_transfer_config)),
    )
    config = _config_kwargs(args)

    def make_engine() -> Any:
        from kvrunner import AsyncLLM

        return AsyncLLM(config_file=args.config_file, **config)

    return serve_forever(settings, make_engine)


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="interface to listen on; 0.0.0.0 for every one "
                       "(default: %(default)s, this machine only)")
    group.add_argument("--port", type=int, default=8000,
                       help="port; 0 picks a free one, printed on start-up "
                       "(default: %(default)s)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route "
                       "(default: $KVRUNNER_API_KEY, else none)")
    group.add_argument("--enable-rl-endpoints", action="store_true",
                       help="serve the control routes (weights, memory, pause, flush, abort); "
                       "off, they answer 403")
    group.add_argument("--weight-transfer-config", default=None, metavar="JSON",
                       help="vLLM's weight transfer: '{\"backend\": \"nccl\"}' serves "
                       "/init_weight_transfer_engine, /start_weight_update, /update_weights "
                       "and /finish_weight_update over a weight-update group (gloo on a CPU "
                       "engine); '{\"backend\": \"ipc\"}' serves them with CUDA IPC handles "
                       "from a colocated trainer")
    group.add_argument("--served-model-name", default=None,
                       help="the model name clients pass (default: the --model setting)")
    group.add_argument("--max-n", type=_positive_int, default=16,
                       help="most samples per request (default: %(default)s)")
    group.add_argument("--max-body-bytes", type=_positive_int, default=64 * 1024 * 1024,
                       help="the largest request body read; a larger one is refused with "
                       "413 before it is parsed (default: %(default)s, 64 MiB)")
    group.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="read tool calls out of chat outputs into tool_calls, as vLLM's "
                       "parser of that name does: hermes, qwen3_coder (default: none)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="parse calls for tool_choice 'auto' (OpenAI's default when tools "
                       "are given); needs --tool-call-parser")
    group.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help="split chat outputs' reasoning into reasoning_content, as vLLM's "
                       "parser of that name does: qwen3 (default: none)")
    group.add_argument("--shutdown-mode", default="abort", choices=["abort", "drain"],
                       help="on SIGTERM, abort the requests in flight or let them finish "
                       "(default: %(default)s)")
    group.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds a drain may take before the rest is aborted "
                       "(default: %(default)s)")
    group.add_argument("--log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="the HTTP server's log level (default: %(default)s)")


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse turns the error into a usage line)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrunner", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"kvrunner {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("backends", help="list installed backends, their layer types and API")
    p.set_defaults(func=_cmd_backends)

    p = sub.add_parser("check-backend",
                       help="run the conformance kit on an installed backend (needs hypothesis)")
    p.add_argument("name", help="the backend's entry-point name")
    p.add_argument("--check", action="append", default=None,
                   help="run only this check (repeatable; default: every check)")
    p.add_argument("--examples", type=int, default=8,
                   help="hypothesis cases per check (default: %(default)s)")
    p.add_argument("--triton", action="store_true",
                   help="run the backend's Triton kernels (interpreted without CUDA)")
    p.add_argument("--overlap", default=None,
                   help="with this overlap plugin on top, cutting every step it can")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                   help="build the backend with this kv_cache_dtype (fp8: the references "
                   "attend keys and values rounded to e4m3)")
    p.set_defaults(func=_cmd_check_backend)

    p = sub.add_parser("make-tiny", help="write a random HF-format checkpoint with tokenizer.json")
    p.add_argument("path", help="directory to write (refused if it exists and is not empty)")
    p.add_argument("--kind", default="qwen3", choices=_tiny_kinds(),
                   help="architecture (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights (default: %(default)s)")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty directory, replacing files of the same name")
    p.set_defaults(func=_cmd_make_tiny)

    p = sub.add_parser("generate", help="generate text for prompts")
    p.add_argument("prompt", nargs="+", help="prompt text (or token ids with --token-ids)")
    p.add_argument("--token-ids", action="store_true",
                   help="each PROMPT is comma-separated token ids, as for a model without "
                   "a tokenizer")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="tokens to generate per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k likeliest tokens; 0 is off (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass in (0, 1]; 1 is off (default: %(default)s)")
    p.add_argument("--sample-seed", type=int, default=None,
                   help="seed of each request's sampling (default: unseeded)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past end-of-sequence tokens")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="print each token's logprob and the N likeliest tokens' "
                   "(at most max_logprobs; default: none)")
    p.add_argument("--stop-token-ids", type=_token_id_list, default=(), metavar="ID,ID,...",
                   help="token ids that end a request (besides the model's EOS)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="a string that ends a request, left out of its text (repeatable; "
                   "needs the model's tokenizer)")
    p.add_argument("--n", type=int, default=1, metavar="N",
                   help="samples per prompt (default: %(default)s)")
    _add_config_flags(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser(
        "rollout", help="RL loop: generate, sleep, push weights, wake and recapture, per round"
    )
    p.add_argument("--rounds", type=_positive_int, default=3,
                   help="rounds to run, at least 1 (default: %(default)s)")
    p.add_argument("--batch", type=_positive_int, default=8,
                   help="prompts per round, at least 1 (default: %(default)s)")
    p.add_argument("--max-tokens", type=_positive_int, default=32,
                   help="tokens to generate per prompt, at least 1 (default: %(default)s)")
    p.add_argument("--token-ids", action="store_true",
                   help="prompts of random token ids, not text: for a checkpoint without "
                   f"a tokenizer ({DEFAULT_PROMPT_LEN} tokens unless --prompt-len says)")
    p.add_argument("--prompt-len", type=_positive_int, default=None, metavar="L",
                   help="prompts of L random token ids (implies --token-ids)")
    p.add_argument("--prompt-seed", type=int, default=0,
                   help="seed the random token-id prompts are drawn with (default: %(default)s)")
    p.add_argument("--sleep-level", type=int, default=1, choices=[1, 2],
                   help="1: free graphs and cache pools; 2: the weights too "
                   "(default: %(default)s)")
    p.add_argument("--update", default="none", choices=["none", "same", "perturbed"],
                   help="weights pushed before each wake: none, the checkpoint's own, or "
                   "alternately a perturbed copy and the own again (default: %(default)s)")
    _add_config_flags(p)
    p.set_defaults(func=_cmd_rollout)

    p = sub.add_parser(
        "serve", help="HTTP server: OpenAI-compatible and SGLang-shaped RL routes, /metrics "
        "(needs kvrunner[serve])"
    )
    _add_serve_flags(p)
    _add_config_flags(p)
    p.set_defaults(func=_cmd_serve)

    for command in sub.choices.values():
        command.add_argument("-v", "--verbose", "--traceback", action="store_true",
                             help="on an error, print the full traceback")
    return parser


def _tiny_kinds() -> list[str]:
    from kvrunner.models.tiny import TINY_KINDS

    return sorted(TINY_KINDS)


def _one_line(error: KvrunnerError) -> str:
    """The message without a rank's traceback (which ``-v`` shows)."""
    return str(error).split("\n--- traceback", 1)[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the process exit status.

    kvrunner's own errors (configuration, checkpoint, request, backend, worker) are
    printed as one message, exit status 2; ``-v``/``--traceback`` adds the traceback.
    ``generate`` exits 1 when a request ended with finish reason ``error`` (its reason
    printed beside it).
    Anything else is a bug and keeps its traceback, and so does a backend hook that
    raised (:class:`BackendHookError`). Ctrl-C exits with 130, quietly.
    """
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("kvrunner: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KvrunnerError as e:
        # A backend's hook that raised is a bug in the backend: its traceback is the news.
        if args.verbose or isinstance(e, BackendHookError):
            traceback.print_exc()
        print(f"kvrunner: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
