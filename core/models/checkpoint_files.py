"""Reading a checkpoint directory's files, each fault a :class:`CheckpointError`.

A checkpoint as Hugging Face writes it: ``config.json``; the weights in one
``model.safetensors`` or in shards listed by ``model.safetensors.index.json``;
optionally ``generation_config.json``, ``tokenizer.json`` (plus
``tokenizer_config.json``, which the ``tokenizers`` file already covers). A
trainer's ``save_pretrained`` of a bare model writes no tokenizer at all, and that
is a valid checkpoint: prompts are then token ids.

A truncated or malformed file is reported as one error naming the file and what is
wrong with it, before any weight is loaded: safetensors headers are read and
checked against the file size up front, so a half-copied shard is refused rather
than failing (or half-loading) midway.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from kvrunner.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
#: a safetensors header longer than this is corrupt, not real (the format caps it)
_MAX_HEADER = 100 << 20


def read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object in ``file``; CheckpointError if missing, not JSON, or not an object."""
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(file, "does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(file, f"cannot be read: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        truncated = " (the file looks truncated)" if e.pos >= len(text.rstrip()) else ""
        raise CheckpointError(
            file, f"is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}{truncated}"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(
            file, f"must hold a JSON object ({{...}}), but holds a {_json_kind(data)}"
        )
    return data


def _json_kind(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def safetensors_files(path: Path) -> tuple[list[Path], dict[str, str]]:
    """The weight files of checkpoint ``path``, and the index's tensor -> file map.

    With ``model.safetensors.index.json`` the shards are exactly those it lists (a
    stray ``*.safetensors`` beside them is not loaded); without, every
    ``*.safetensors`` file in the directory, and the map is empty.
    """
    index = path / INDEX_FILE
    if not index.exists():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                path, "holds no *.safetensors weights (and no model.safetensors.index.json)"
            )
        return files, {}
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(index, "has no \"weight_map\" object naming tensors and shards")
    bad = [f for f in weight_map.values() if not isinstance(f, str) or "/" in f or "\\" in f]
    if bad:
        raise CheckpointError(index, f"weight_map names invalid shard file(s) {bad[:3]}")
    files = [path / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(index, f"lists shard(s) that do not exist: {', '.join(missing)}")
    return files, dict(weight_map)


def safetensors_tensor_names(file: Path) -> list[str]:
    """The tensor names in a safetensors file, after checking its header and size.

    The header is an 8-byte little-endian length and that many bytes of JSON; every
    tensor's ``data_offsets`` must lie inside the data that follows.
    """
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(file, f"is truncated: {size} bytes, not even a header")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER:
                raise CheckpointError(
                    file, f"has a bad safetensors header: a header length of {length} bytes"
                )
            if 8 + length > size:
                raise CheckpointError(
                    file, f"is truncated: its header needs {8 + length} bytes, the file has "
                    f"{size}"
                )
            raw = f.read(length)
    except OSError as e:
        raise CheckpointError(file, f"cannot be read: {e}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(file, f"has a bad safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(file, "has a bad safetensors header (not a JSON object)")
    end = 0
    names = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(
                file, f"has a bad safetensors header: tensor {name!r} has no valid data_offsets"
            )
        end = max(end, offsets[1])
        names.append(name)
    if 8 + length + end > size:
        raise CheckpointError(
            file, f"is truncated: its tensors need {8 + length + end} bytes, the file has {size}"
        )
    return names


def check_weight_files(path: Path) -> list[Path]:
    """Every weight file of checkpoint ``path``, each header checked, the index (if
    any) checked against what the shards hold; CheckpointError on the first fault."""
    files, weight_map = safetensors_files(path)
    held: dict[str, str] = {}
    for file in files:
        for name in safetensors_tensor_names(file):
            held[name] = file.name
    wrong = [(t, f) for t, f in weight_map.items() if held.get(t) != f]
    if wrong:
        tensor, shard = wrong[0]
        raise CheckpointError(
            path / INDEX_FILE,
            f"says tensor {tensor!r} is in {shard}, but that shard does not hold it"
            + (f" ({len(wrong) - 1} more like it)" if len(wrong) > 1 else ""),
        )
    return files


def has_tokenizer(path: Path, *, skip: bool = False) -> bool:
    """Whether :func:`load_tokenizer` gives a tokenizer for checkpoint ``path``, from
    its files alone (nothing is loaded): a command can say what to pass instead
    before it spends a model load."""
    return not skip and (path / TOKENIZER_FILE).exists()


def load_tokenizer(path: Path, *, skip: bool = False) -> Tokenizer | None:
    """The checkpoint's ``tokenizer.json``; None if it has none or ``skip`` is set."""
    file = path / TOKENIZER_FILE
    if not has_tokenizer(path, skip=skip):
        return None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise CheckpointError(file, f"is not a valid tokenizers file: {e}") from None
