"""Run under ``torchrun --nproc-per-node 2``: rank 0 generates, sleeps at both levels,
pushes the weights back by name, wakes, and generates again; it prints one JSON line
with what each round gave and the pool's block counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from kvrunner import SamplingParams
from kvrunner.launch import launch
from kvrunner.models.loader import iter_safetensors


def main() -> None:
    path = sys.argv[1]
    llm = launch(path, max_num_seqs=2, max_model_len=64, capture_sizes=(1, 2))
    if llm is None:  # ranks > 0 served until rank 0 shut down
        return
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    rounds, blocks = [], []
    for level, discard in ((1, False), (2, False), (2, True)):
        rounds.append([o.token_ids for o in llm.generate(prompts, params)])
        blocks.append(llm.cache_info().num_blocks)
        llm.sleep(level, discard_weights=discard)
        if discard:
            llm.wake_up(["weights"])
            llm.update_weights(iter_safetensors(Path(path), torch.float32))
        llm.wake_up()
    rounds.append([o.token_ids for o in llm.generate(prompts, params)])
    blocks.append(llm.cache_info().num_blocks)
    ranks = [r.rank for r in llm.cache_info().ranks]
    llm.shutdown()
    print(json.dumps({"rounds": rounds, "blocks": blocks, "ranks": ranks}), flush=True)


if __name__ == "__main__":
    main()
