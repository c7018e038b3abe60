"""The main job: the RL rollout loop on one engine, as a trainer drives it.

Each round generates the same batch (seeded sampling, so a correct runtime repeats
itself exactly), then sleeps (level 1 or 2) as if a trainer took the GPU, optionally
pushes weights back (the checkpoint's own, or a perturbed copy), wakes and
recaptures its decode graphs — with forward_vars still holding the last served
batch's live rows. A capture that wrote into the cache, a pool that came back at
another size, or weights that came back wrong show up as non-finite rows (the
engine's count, ``cache_info().nonfinite_rows``), a changed block count, or outputs
that differ from round 1.

With ``update="perturbed"`` the rounds alternate: even rounds serve a perturbed
copy, odd rounds the checkpoint's own weights again, which must answer exactly as
round 1 did.

The prompts are text, or (``prompt_len``) random token ids, which is what a
trainer's checkpoint without a tokenizer can be served with.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvrunner.config import EngineConfig
from kvrunner.llm import LLM
from kvrunner.models.loader import iter_safetensors
from kvrunner.prompts import require_tokenizer
from kvrunner.sampling_params import SamplingParams

_TEXT = (
    "the policy samples a rollout and the trainer updates its weights then the engine "
    "wakes recaptures its graphs and serves the next batch of prompts"
)
_WORDS = _TEXT.split()
#: how weights come back after each sleep
UPDATES = ("none", "same", "perturbed")


def rollout_prompts(batch: int) -> list[str]:
    """``batch`` prompts of different lengths, the same every call."""
    return [
        " ".join(_WORDS[(i * 7) % len(_WORDS) :] + _WORDS[: 3 + (i * 5) % 11]) for i in range(batch)
    ]


def rollout_token_prompts(
    batch: int, prompt_len: int, vocab_size: int, seed: int
) -> list[list[int]]:
    """``batch`` prompts of ``prompt_len`` token ids drawn uniformly from the
    vocabulary, the same for the same ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, prompt_len), generator=gen).tolist()


def trainer_weights(path: Path, *, perturb_seed: int | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as a trainer pushes them (float32, full, by HF name),
    each scaled by ``1 + 0.05 * noise`` when ``perturb_seed`` is given."""
    gen = torch.Generator().manual_seed(perturb_seed or 0)
    for name, tensor in iter_safetensors(path, torch.float32):
        if perturb_seed is not None:
            tensor = tensor * (1 + 0.05 * torch.randn(tensor.shape, generator=gen))
        yield name, tensor


def run_rollout(
    *,
    config_file: str | Path | None,
    rounds: int,
    batch: int,
    max_tokens: int,
    config: dict[str, Any],
    sleep_level: int = 1,
    update: str = "none",
    prompt_len: int | None = None,
    prompt_seed: int = 0,
) -> int:
    """Run the loop and print one table row per round; returns a process exit code
    (1 when any round lost anything).

    :param prompt_len: roll out on random token-id prompts of this many tokens (drawn
        with ``prompt_seed``) rather than on text, which needs a tokenizer.
    """
    if sleep_level not in (1, 2):
        raise ValueError(f"--sleep-level must be 1 or 2; got {sleep_level}")
    if update not in UPDATES:
        raise ValueError(f"--update must be one of {', '.join(UPDATES)}; got {update!r}")
    if prompt_len is None:  # refused before the model loads, not after
        require_tokenizer(EngineConfig.load(config_file, **config), "rollout's text prompts",
                          "pass --token-ids (or --prompt-len L) to roll out on random "
                          "token-id prompts of L tokens")
    llm = LLM(config_file=config_file, progress=True, **config)
    if prompt_len is None:
        prompts: list[Any] = rollout_prompts(batch)
    else:
        prompts = rollout_token_prompts(batch, prompt_len, llm.engine.vocab_size, prompt_seed)
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 + i, ignore_eos=True)
        for i in range(batch)
    ]
    info = llm.executor.model_info
    start_state = llm.executor.describe_ranks()[0]
    start_blocks = llm.cache_info().num_blocks
    kind = "text" if prompt_len is None else f"{prompt_len} random token ids"
    print(
        f"model {info.path.name}: {len(info.layer_types)} layers {sorted(set(info.layer_types))}, "
        f"{llm.config.parallel.tensor_parallel_size} rank(s) on {start_state['device']} "
        f"{start_state['dtype']}, {start_blocks} KV blocks, "
        f"{len(start_state['graph_sizes'])} decode graphs; sleep level {sleep_level}, "
        f"weights pushed: {update}; prompts: {kind}"
    )
    header = (
        f"{'round':>5} {'tok/s':>9} {'sleep s':>8} {'wake s':>7} {'recapture s':>12} "
        f"{'MiB freed':>10} {'KV blocks':>10} {'NaN rows':>9} {'same as round 1':>16}"
    )
    print(header)
    print("-" * len(header))
    first: list[list[int]] | None = None
    lost = False
    for r in range(1, rounds + 1):
        nan_before = llm.cache_info().nonfinite_rows
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = [o.token_ids for o in outs]
        nan_rows = llm.cache_info().nonfinite_rows - nan_before
        # Rounds served by the checkpoint's own weights must repeat round 1 exactly.
        own_weights = update != "perturbed" or r % 2 == 1
        first = first or tokens
        same = "yes" if tokens == first else "NO"
        if not own_weights:
            same = "-"  # a perturbed round: nothing to compare against
        # As a trainer's step would: sleep, push weights, wake (graphs recaptured).
        discard = sleep_level == 2 and update != "none"
        sleep_s = llm.sleep(sleep_level, discard_weights=discard)
        freed = llm.cache_info().last_freed_bytes
        wake_s = llm.wake_up(["weights"])
        if update != "none":
            perturb = r if update == "perturbed" and r % 2 == 1 else None
            llm.update_weights(trainer_weights(info.path, perturb_seed=perturb))
        wake_s += llm.wake_up(["kv_cache"])
        after = llm.cache_info()
        lost |= same == "NO" or nan_rows != 0 or after.num_blocks != start_blocks
        print(
            f"{r:>5} {sum(len(t) for t in tokens) / seconds:>9.1f} {sleep_s:>8.3f} "
            f"{wake_s:>7.3f} {after.last_recapture_s:>12.3f} {freed / 2**20:>10.1f} "
            f"{after.num_blocks:>10} {nan_rows:>9} {same:>16}"
        )
    print(f"rounds that lost anything: {'some' if lost else 'none'}")
    llm.shutdown()
    return 1 if lost else 0
