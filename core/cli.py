"""The ``kvrunner`` command: backends, generate, make-tiny, rollout."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import attrs

from kvrunner.config import _SECTIONS, ConfigError
from kvrunner.plugins import BackendError
from kvrunner.runner.sizing import CacheSizingError


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field (``--block-size``), plus ``--config FILE.toml``."""
    parser.add_argument("--config", dest="config_file", help="TOML file with engine settings")
    parser.add_argument("--model", default=None, help="HF-format directory or embedded default")
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=None)
    for section, klass in _SECTIONS.items():
        group = parser.add_argument_group(f"[{section}]")
        for field in attrs.fields(klass):
            flag = "--" + field.name.replace("_", "-")
            if field.type in ("bool", bool):
                group.add_argument(
                    flag, dest=field.name, default=None, action=argparse.BooleanOptionalAction
                )
            elif field.name == "capture_sizes":
                group.add_argument(
                    flag,
                    dest=field.name,
                    default=None,
                    type=lambda s: tuple(int(x) for x in s.split(",")),
                )
            else:
                kind = {"int": int, "float": float, "str": str}.get(str(field.type).split(" ")[0])
                group.add_argument(flag, dest=field.name, default=None, type=kind or _int_or_none)


def _int_or_none(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = {"model", "dtype", "device", "seed"} | {
        f.name for klass in _SECTIONS.values() for f in attrs.fields(klass)
    }
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def _cmd_backends(args: argparse.Namespace) -> int:
    from kvrunner.plugins import discover_backends

    found = discover_backends()
    if not found:
        print("no backends installed (group kvrunner.backends)")
        return 1
    print(f"{'name':<10} {'distribution':<18} {'version':<9} {'layer types':<28} write targets")
    for name, backend in sorted(found.items()):
        try:
            factory = backend.load()
            layer_types, targets = ", ".join(factory.layer_types), ", ".join(factory.write_targets)
        except BackendError as e:
            layer_types, targets = "-", f"LOAD ERROR: {e}"
        print(
            f"{name:<10} {backend.distribution:<18} {backend.version:<9} "
            f"{layer_types:<28} {targets}"
        )
    return 0


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from kvrunner.models.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(args.path, kind=args.kind, seed=args.seed)
    print(f"wrote {args.kind} checkpoint to {path}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvrunner import LLM, SamplingParams

    llm = LLM(config_file=args.config_file, progress=True, **_config_kwargs(args))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.sample_seed,
        ignore_eos=args.ignore_eos,
    )
    for out in llm.generate(args.prompt, params):
        print(f"--- {out.prompt!r} -> {out.finish_reason}")
        print(out.text)
    return 0


def _cmd_rollout(args: argparse.Namespace) -> int:
    from kvrunner.rollout import run_rollout

    return run_rollout(
        config_file=args.config_file,
        rounds=args.rounds,
        batch=args.batch,
        max_tokens=args.max_tokens,
        config=_config_kwargs(args),
        sleep_level=args.sleep_level,
        update=args.update,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrunner", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list installed backends and their write targets")
    p.set_defaults(func=_cmd_backends)

    p = sub.add_parser("make-tiny", help="write a random HF-format checkpoint with tokenizer.json")
    p.add_argument("path")
    p.add_argument("--kind", default="qwen3")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_make_tiny)

    p = sub.add_parser("generate", help="generate text for prompts")
    p.add_argument("prompt", nargs="+")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sample-seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    _add_config_flags(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser(
        "rollout", help="RL loop: generate, sleep, push weights, wake and recapture, per round"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--sleep-level", type=int, default=1, choices=[1, 2],
                   help="1: free graphs and cache pools; 2: the weights too (default: 1)")
    p.add_argument("--update", default="none", choices=["none", "same", "perturbed"],
                   help="weights pushed before each wake: none, the checkpoint's own, or "
                   "alternately a perturbed copy and the own again (default: none)")
    _add_config_flags(p)
    p.set_defaults(func=_cmd_rollout)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError, BackendError, CacheSizingError) as e:
        print(f"kvrunner: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
