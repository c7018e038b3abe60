"""Deterministic tiny random checkpoints in Hugging Face format, and the built-in defaults.

``write_tiny_checkpoint`` writes a complete, loadable checkpoint directory (by
kvrunner *and* by transformers) whose weights come from a seeded generator, so
tests, examples and CI run a real model end to end without downloading one. The
bytes depend only on ``(kind, seed)``.

``ensure_default_model(name)`` materializes a named default under
``$KVRUNNER_HOME/models/<name>`` on first use (the names are
:data:`DEFAULT_MODELS`). Other modules add kinds through :data:`TINY_KINDS`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvrunner.errors import ConfigError
from kvrunner.models.tiny_fp8 import tiny_qwen3_blocks, tiny_qwen3_moe_blocks
from kvrunner.models.tiny_moe_weights import tiny_qwen3_moe, tiny_qwen3_next_moe
from kvrunner.models.tiny_weights import tiny_qwen3, tiny_qwen3_next

# ---------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_VOCAB = 480

#: Training text for the tiny tokenizer: plain English, written for this file.
_CORPUS = """\
The little engine woke before the sun and listened to the rain on the roof of the shed.
Every morning it counted the wagons, checked the brakes, and read the list of towns it
would visit. Some days the list was short and the hills were gentle; other days the list
ran to the bottom of the page and the track climbed through the cold mountains.

A model reads one word, then another, and guesses what comes next. It keeps a small
memory of everything it has read so far, so that the next guess can look back at the
start of the sentence. When the memory is full, the oldest pages are moved aside, and
the reader must be careful never to write on a page that another story still needs.

In the garden there were seven rows of beans, three rows of carrots, and a single
stubborn pumpkin that grew larger every week. The children measured it with a piece of
string and wrote the numbers on the kitchen wall: forty, fifty-two, sixty-one, seventy.
Nobody knew how big it would become, but everybody agreed it should win the fair.

Questions are answered faster when the work is shared. One team prepares the batch,
another team runs the numbers, and a third team checks that nothing was lost on the way.
If a step fails, the whole group stops together and reports the same clear message,
because a silent mistake at step four thousand is far worse than a loud one at step one.

The river was wide and slow near the town, with boats, bridges, and a market on the
eastern bank. Traders sold bread, cheese, apples, fish, and warm soup in the evening.
At night the lamps were lit one by one, and their light made long golden lines on the
water while the bells of the old tower rang the hours.
"""


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer trained on :data:`_CORPUS` (deterministic).

    Byte-level, so every string round-trips through encode/decode, even text the
    corpus never saw. ``<|endoftext|>`` is the only special token (id 0).
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.split("\n\n"), trainer)
    return tokenizer


#: The tiny checkpoints' chat template: ChatML turns (``<|im_start|>role ... <|im_end|>``,
#: written as plain text: the tiny tokenizer has no such special tokens), tools listed
#: as JSON in a system turn, an assistant's tool calls as ``<tool_call>`` JSON lines, a
#: tool's answer as a ``tool`` turn, and ``enable_thinking=False`` closing an empty
#: ``<think>`` block after the generation prompt, as Qwen3's template does. Enough for
#: every chat feature of the server to run end to end on the embedded models.
CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if not (tools and loop.first and message.role == 'system') %}
<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""


# ---------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------

#: ``kind -> (generator, vocab_size, eos_id) -> (config.json dict, tensors by HF name)``
TinyKind = Callable[[torch.Generator, int, int], tuple[dict[str, Any], dict[str, torch.Tensor]]]


TINY_KINDS: dict[str, TinyKind] = {
    "qwen3": tiny_qwen3,
    "qwen3-next": tiny_qwen3_next,
    "qwen3-moe": tiny_qwen3_moe,
    "qwen3-next-moe": tiny_qwen3_next_moe,
    "qwen3-blocks": tiny_qwen3_blocks,
    "qwen3-moe-blocks": tiny_qwen3_moe_blocks,
}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_tiny_checkpoint(path: str | Path, *, kind: str = "qwen3", seed: int = 0) -> Path:
    """Write a tiny random HF-format checkpoint of ``kind`` into directory ``path``.

    Files: config.json, model.safetensors, tokenizer.json, tokenizer_config.json (with
    :data:`CHAT_TEMPLATE`), generation_config.json. The vocabulary is the tokenizer's,
    rounded up to a multiple of 64 (as real checkpoints pad theirs).
    """
    if kind not in TINY_KINDS:
        raise ValueError(f"unknown tiny checkpoint kind {kind!r}; known: {sorted(TINY_KINDS)}")
    path = Path(path)
    with _writing(path, "write a checkpoint"):
        return _write_tiny(path, kind, seed)


def _write_tiny(path: Path, kind: str, seed: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer: Tokenizer = build_tokenizer()
    eos = tokenizer.token_to_id(EOS_TOKEN)
    vocab = -(-tokenizer.get_vocab_size() // 64) * 64
    gen = torch.Generator().manual_seed(seed)
    config, tensors = TINY_KINDS[kind](gen, vocab, eos)
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", {"bos_token_id": eos, "eos_token_id": eos})
    _write_json(
        path / "tokenizer_config.json",
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN,
         "model_max_length": config.get("max_position_embeddings", 4096),
         "chat_template": CHAT_TEMPLATE},
    )
    (path / "tokenizer.json").write_text(tokenizer.to_str(pretty=True))
    return path


# ---------------------------------------------------------------------------
# built-in default models
# ---------------------------------------------------------------------------

#: default model name -> writer that fills an (existing, empty) directory
DEFAULT_MODELS: dict[str, Callable[[Path], Any]] = {
    "tiny-qwen3": lambda path: write_tiny_checkpoint(path, kind="qwen3", seed=0),
    "tiny-qwen3-next": lambda path: write_tiny_checkpoint(path, kind="qwen3-next", seed=0),
    "tiny-qwen3-moe": lambda path: write_tiny_checkpoint(path, kind="qwen3-moe", seed=0),
    "tiny-qwen3-next-moe": lambda path: write_tiny_checkpoint(path, kind="qwen3-next-moe",
                                                              seed=0),
}


def kvrunner_home() -> Path:
    """Where the embedded models are written: ``$KVRUNNER_HOME``, else ``~/.cache/kvrunner``."""
    return Path(os.environ.get("KVRUNNER_HOME") or "~/.cache/kvrunner").expanduser()


@contextlib.contextmanager
def _writing(path: Path, what: str, remedy: str = "choose a writable directory") -> Iterator[None]:
    """Turn a file system's refusal while writing under ``path`` into one ConfigError
    naming the path, the reason and what to do."""
    try:
        yield
    except OSError as e:
        where = e.filename or path
        raise ConfigError(f"cannot {what} in {path}: {where}: {e.strerror or e}; "
                          f"{remedy}") from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def temp_prefix(name: str) -> str:
    """Name prefix of this host's temp dirs for ``name``; a temp's full name adds
    ``<pid>-<random>``, so a crashed writer's leftovers can be recognized."""
    return f".{name}.tmp-{socket.gethostname().replace('-', '_')}-"


def _remove_stale_temps(root: Path, name: str) -> None:
    """Delete temp dirs a crashed writer on this host left behind (its pid is gone).

    Temps of live processes are in progress; temps from other hosts (a shared home)
    cannot be judged from here and are left alone.
    """
    prefix = temp_prefix(name)
    for tmp in root.glob(prefix + "*"):
        try:
            pid = int(tmp.name.removeprefix(prefix).split("-")[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            shutil.rmtree(tmp, ignore_errors=True)


def _fsync_tree(path: Path) -> None:
    for file in path.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())


def ensure_default_model(name: str) -> Path:
    """The path of built-in model ``name``, writing it on first use.

    The checkpoint is written into a private temp directory beside its final place
    and renamed into place only when complete, so a crash never leaves a half
    checkpoint where a later run would load it. A concurrent first use by another
    process is harmless: the loser of the rename discards its copy.
    """
    if name not in DEFAULT_MODELS:
        raise ValueError(f"unknown default model {name!r}; known: {sorted(DEFAULT_MODELS)}")
    root = kvrunner_home() / "models"
    dest = root / name
    if (dest / "config.json").exists():
        return dest
    if dest.exists():
        raise ConfigError(f"{dest} exists but holds no config.json; remove it to rebuild")
    remedy = "set KVRUNNER_HOME to a writable directory (default ~/.cache/kvrunner)"
    with _writing(root, f"write the embedded model {name}", remedy):
        return _write_default(name, root, dest)


def _write_default(name: str, root: Path, dest: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(root, name)
    tmp = root / f"{temp_prefix(name)}{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        DEFAULT_MODELS[name](tmp)
        _fsync_tree(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "config.json").exists():
                raise
            # Another process finished first; its copy is identical (deterministic writer).
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
