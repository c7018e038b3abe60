"""Run under ``torchrun --nproc-per-node 2`` with a fault plan that fails rank 1 in
a step: rank 0 catches the error, takes its time (as a loaded machine would), then
tries again and prints one JSON line saying what each attempt raised."""

from __future__ import annotations

import json
import sys
import time

from kvrunner import SamplingParams
from kvrunner.distributed.errors import WorkerError
from kvrunner.launch import launch


def attempt(llm: object, params: SamplingParams) -> dict[str, object]:
    try:
        llm.generate([[1, 2, 3], [4, 5]], params)  # type: ignore[attr-defined]
    except WorkerError as e:
        return {"rank": e.rank, "message": str(e).splitlines()[0]}
    return {"rank": None, "message": "generated"}


def main() -> None:
    llm = launch(sys.argv[1], enforce_eager=True, max_num_seqs=2, max_model_len=64)
    if llm is None:
        return
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = attempt(llm, params)
    time.sleep(float(sys.argv[2]))
    again = attempt(llm, params)
    llm.shutdown()
    print(json.dumps({"first": first, "again": again}), flush=True)


if __name__ == "__main__":
    main()
