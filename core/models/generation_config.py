"""Sampling defaults a checkpoint ships in ``generation_config.json``.

As vLLM's ``generation_config="auto"``: the keys :class:`SamplingParams` supports
(``temperature``, ``top_p``, ``top_k``, and ``max_new_tokens`` as ``max_tokens``) become
the defaults of a request made without SamplingParams. Other keys (``do_sample``,
``repetition_penalty`` ...) are not read. A value SamplingParams would refuse is a
:class:`~kvrunner.errors.CheckpointError` naming the file and the key, at start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvrunner.errors import CheckpointError, RequestError
from kvrunner.models.checkpoint_files import read_json_object
from kvrunner.sampling_params import SamplingParams

#: generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(path: str | Path) -> dict[str, Any]:
    """The SamplingParams fields ``path/generation_config.json`` sets ({} without one)."""
    file = Path(path) / "generation_config.json"
    if not file.exists():
        return {}
    raw = read_json_object(file)
    found = {field: raw[key] for key, field in SAMPLING_KEYS.items() if raw.get(key) is not None}
    for field, value in found.items():
        try:
            SamplingParams(**{field: value})
        except RequestError as e:
            key = next(k for k, f in SAMPLING_KEYS.items() if f == field)
            raise CheckpointError(file, f"{key}={value!r} is not a usable default: {e}") from None
    return found
