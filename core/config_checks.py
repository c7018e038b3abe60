"""Checks on raw configuration values, before the config classes are built.

A TOML file or a keyword argument can hold anything; these checks turn a value of
the wrong type, a key in the wrong place or a misspelt section into a
:class:`~kvrunner.errors.ConfigError` that says which field it is and what to do,
instead of a comparison error deep inside a validator.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from collections.abc import Iterable, Mapping
from numbers import Integral, Real
from pathlib import Path
from typing import Any

from kvrunner.errors import ConfigError

#: device names the runner can resolve (``resolve_device``)
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _is_int(value: Any) -> bool:
    # bool is an int to Python, but ``block_size = true`` is a mistake, not 1.
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


_KINDS: dict[str, tuple[str, Any]] = {
    "int": ("an integer", _is_int),
    "float": ("a number", _is_real),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "int | None": ("an integer (or omitted)", lambda v: v is None or _is_int(v)),
    "tuple[int, ...] | None": (
        "a list of integers",
        lambda v: v is None
        or (isinstance(v, list | tuple) and all(_is_int(x) for x in v)),
    ),
}


def check_type(where: str, name: str, type_text: str, value: Any) -> None:
    """Raise ConfigError if ``value`` is not of the field's declared type.

    :param where: ``"[cache]"`` for a section, ``""`` at the top level.
    :param type_text: the attrs field's annotation, as written in ``config.py``.
    """

    kind = _KINDS.get(type_text)
    if kind is None or kind[1](value):
        return
    label = f"{where} {name}".strip()
    raise ConfigError(f"{label} must be {kind[0]}, got {value!r} ({type(value).__name__})")


def check_number(label: str, value: Any, lo: float, hi: float) -> None:
    """Raise ConfigError unless ``value`` is a finite number in ``[lo, hi]``."""

    if not _is_real(value) or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(f"{label} must be a number in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{label} must be in [{lo}, {hi}], got {value}")


def check_device(name: Any) -> None:
    """Raise ConfigError unless ``name`` is a device the runner can use."""

    if not isinstance(name, str) or not _DEVICE.fullmatch(name):
        raise ConfigError(
            f"device must be one of auto, cpu, cuda or cuda:<index>; got {name!r}"
        )


def capture_sizes_tuple(sizes: Any) -> tuple[int, ...] | None:
    """``capture_sizes`` as the config keeps it: sorted, without repeats; each a
    positive integer (ConfigError naming the field and the bad sizes otherwise)."""

    if sizes is None:
        return None
    if isinstance(sizes, str | bytes) or not isinstance(sizes, Iterable):
        raise ConfigError(f"capture_sizes must be a list of integers, got {sizes!r}")
    sizes = list(sizes)
    if not sizes:
        # None already means the default list; an empty one would silently mean it too.
        raise ConfigError(
            "capture_sizes must list at least one batch size; to capture no decode "
            "graphs set enforce_eager = true"
        )
    bad = [s for s in sizes if not _is_int(s) or s < 1]
    if bad:
        raise ConfigError(
            f"capture_sizes must be positive integers (decode batch sizes); got {bad[:5]}"
        )
    return tuple(sorted({int(s) for s in sizes}))


#: ``[cache] kv_cache_dtype`` values: "fp8_e4m3" is vLLM's other name for "fp8"
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def canonical_kv_cache_dtype(name: Any) -> Any:
    """``kv_cache_dtype`` as the config keeps it: vLLM's "fp8_e4m3" is "fp8" (e4m3 is the
    one FP8 format served); anything else passes through to the field's check."""

    return "fp8" if name == "fp8_e4m3" else name


def check_capture_sizes(sizes: tuple[int, ...] | None, *, max_num_seqs: int) -> None:
    """Refuse a capture size above ``max_num_seqs``: no decode step is ever that large,
    so its graph would never replay (a size the user listed would silently do nothing,
    and a list of only such sizes would leave every decode step eager)."""

    above = [s for s in sizes or () if s > max_num_seqs]
    if above:
        raise ConfigError(
            f"capture_sizes {above} exceed max_num_seqs={max_num_seqs}: no decode step "
            f"is larger than max_num_seqs, so those graphs would never run; lower them "
            f"or raise max_num_seqs"
        )


def _suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def misplaced_top_key(
    key: str, value: Any, *, sections: Iterable[str], flat_keys: Mapping[str, str],
    top_keys: Iterable[str],
) -> str:
    """What to tell a user who wrote ``key`` at the top level of a TOML file, where
    it does not belong."""
    sections = list(sections)
    if isinstance(value, Mapping):
        listed = ", ".join(f"[{s}]" for s in sections)
        return f"unknown section [{key}]{_suggest(key, sections)}; valid sections: {listed}"
    if key in flat_keys:
        return (
            f"{key} belongs in the [{flat_keys[key]}] section, not at the top level: "
            f"write it under [{flat_keys[key]}]"
        )
    known = sorted(top_keys)
    return (
        f"unknown top-level key {key!r}{_suggest(key, [*known, *flat_keys])}; "
        f"valid top-level keys: {', '.join(known)}; sections: "
        + ", ".join(f"[{s}]" for s in sections)
    )


def misplaced_section_key(
    section: str, key: str, *, valid: Iterable[str], flat_keys: Mapping[str, str],
    top_keys: Iterable[str],
) -> str:
    """What to tell a user who wrote ``key`` in ``[section]``, where it does not belong."""
    if key in flat_keys:
        return f"{key} belongs in the [{flat_keys[key]}] section, not [{section}]"
    if key in set(top_keys):
        return f"{key} is a top-level key: write it above every [section], not in [{section}]"
    valid = sorted(valid)
    return f"unknown key {key!r} in [{section}]{_suggest(key, valid)}; valid: {', '.join(valid)}"


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file's contents; ConfigError naming the file if it is missing or invalid."""

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {str(path)!r} is a directory, not a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text: {e}") from None
