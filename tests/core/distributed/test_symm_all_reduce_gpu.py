"""The symmetric-memory all-reduce sums what NCCL sums, eagerly and in a CUDA graph.

Two GPUs of one host; the ranks run ``symm_all_reduce_ranks.py`` under torchrun.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvrunner.config import ConfigError
from kvrunner.distributed import symm_all_reduce

RANKS_SCRIPT = Path(__file__).with_name("symm_all_reduce_ranks.py")
#: one rounding of the sum apart from NCCL's, relative to the largest value
TOLERANCE = {"torch.bfloat16": 2.0**-7, "torch.float32": 1e-6}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_symmetric_all_reduce_equals_nccl_eagerly_and_replayed(dtype: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(RANKS_SCRIPT), dtype],
        capture_output=True, text=True, timeout=150,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    report = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert report["impl"] == "symm_mem"
    paths = {r["path"] for r in report["results"]}
    assert paths == {"symm_mem", "nccl"}, "the sizes should cover both paths"
    for r in report["results"]:
        bound = TOLERANCE[r["dtype"]] * r["scale"]
        assert r["eager_err"] <= bound, r
        assert r["graph_err"] <= bound, r


def test_unsupported_places_are_named() -> None:
    cpu = symm_all_reduce.why_unavailable(torch.device("cpu"), torch.bfloat16, [])
    assert cpu == "device cpu is not CUDA"
    fp16 = symm_all_reduce.why_unavailable(torch.device("cuda", 0), torch.float16, [0, 1])
    assert fp16 == "its all-reduce kernels take bfloat16 and float32, not torch.float16"


def test_asking_for_symmetric_memory_on_gloo_is_a_config_error() -> None:
    from kvrunner.distributed.group import DistGroup

    group = DistGroup(rank=0, size=2, device=torch.device("cpu"), backend="gloo",
                      timeout_s=5, store=None, process_group=None)
    with pytest.raises(ConfigError, match="all_reduce='symm_mem' needs NCCL on CUDA, not gloo"):
        group.tp_group(dtype=torch.float32, all_reduce="symm_mem")
