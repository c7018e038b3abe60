"""A tiny Qwen3 checkpoint whose greedy output is a given script, for driving the
server's output parsers end to end through the real engine.

The script's pieces become tokens of their own (added to the tiny tokenizer, not
special, so they decode to their text), and the weights make the model a lookup of
the next token from the current one: every layer's output projections are zero, so
the residual stream is the token's embedding; a piece's embedding is a direction of
its own (every other token shares one), and the LM head maps each direction to the
next piece's token, the last to EOS. Greedy decoding after any prompt that does not
end in a piece's token then writes the script and stops.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

from kvrunner.models.tiny import EOS_TOKEN, write_tiny_checkpoint

#: the logit the next piece gets (every other token's is 0)
_MARGIN = 4.0


def write_scripted_checkpoint(path: Path, pieces: list[str]) -> Path:
    """A tiny Qwen3 checkpoint at ``path`` that answers every prompt with ``pieces``
    (distinct, non-empty) and then EOS."""
    if len(set(pieces)) != len(pieces) or not all(pieces):
        raise ValueError("the script's pieces must be distinct and non-empty")
    write_tiny_checkpoint(path, kind="qwen3", seed=0)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(p, normalized=False, special=False) for p in pieces])
    tokenizer.save(str(path / "tokenizer.json"))
    ids = [tokenizer.token_to_id(p) for p in pieces]
    eos = tokenizer.token_to_id(EOS_TOKEN)

    tensors = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    vocab, hidden = tensors["model.embed_tokens.weight"].shape
    if max(ids) >= vocab or len(pieces) + 1 > hidden:
        raise ValueError(f"{len(pieces)} pieces do not fit the tiny model's vocabulary "
                         f"({vocab}) and width ({hidden})")
    embed = torch.zeros(vocab, hidden)
    embed[:, 0] = 1.0  # every token outside the script: direction 0
    head = torch.zeros(vocab, hidden)
    for k, token in enumerate(ids, start=1):
        embed[token] = 0.0
        embed[token, k] = 1.0
        head[token, k - 1] = _MARGIN  # direction k-1 is followed by piece k
    head[eos, len(ids)] = _MARGIN
    tensors["model.embed_tokens.weight"] = embed
    tensors["lm_head.weight"] = head
    tensors["model.norm.weight"] = torch.ones(hidden)
    for i in range(config["num_hidden_layers"]):
        tensors[f"model.layers.{i}.self_attn.o_proj.weight"].zero_()
        tensors[f"model.layers.{i}.mlp.down_proj.weight"].zero_()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
