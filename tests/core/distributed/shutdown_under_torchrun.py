"""Run under ``torchrun --nproc-per-node 2``: rank 0 generates, shuts down, then
tries again; it prints one JSON line saying what each attempt gave."""

from __future__ import annotations

import json
import sys

from kvrunner import SamplingParams
from kvrunner.launch import launch


def main() -> None:
    llm = launch(sys.argv[1], enforce_eager=True, max_num_seqs=2, max_model_len=64)
    if llm is None:  # ranks > 0 served until rank 0 shut down
        return
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    first = llm.generate([[1, 2, 3]], params)[0].token_ids
    llm.shutdown()
    try:
        llm.generate([[1, 2, 3]], params)
        after = "generated"
    except RuntimeError as e:
        after = f"{type(e).__name__}: {e}"
    print(json.dumps({"first": first, "after_shutdown": after}), flush=True)


if __name__ == "__main__":
    main()
