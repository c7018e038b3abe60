"""Compile the paged prefill kernel for Hopper (sm_90) without a GPU; print its resources.

For each launch configuration: shared memory, registers per thread, local memory
(spills) and how many ``wgmma`` (Hopper tensor-core) instructions its SASS holds (``HGMMA``).
Nothing runs, so this says whether a configuration fits and uses the tensor cores,
not how fast it is: a first filter before timing candidates with ``bench_prefill.py``.
Needs only Triton's bundled ``ptxas`` / ``cuobjdump``; alignment attributes mimic a
real launch (16-byte pointers, strides that are multiples of 16).

    python benchmarks/bench_prefill_compile.py          # LAUNCH, LONG_RUN_LAUNCH; groups 2, 4
    python benchmarks/bench_prefill_compile.py bf16,4,128,128,8,2 fp32,4,64,32,4,2,ieee
"""

from __future__ import annotations

import os
import sys

import torch
import triton
from hopper_compile import compile_sm90

from kvrunner_paged.ops.paged_attention.prefill import LAUNCH, LONG_RUN_LAUNCH, _prefill_kernel

HEAD_DIM = 128
#: each name's launch (``LAUNCH[...]``): ``fp8`` (an e4m3 pool) takes bf16's
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.bfloat16}
#: the queries' and output's type; ``fp8``: bf16 queries over an e4m3 pool
TYPE_NAMES = {"bf16": "*bf16", "fp32": "*fp32", "fp8": "*bf16"}
POOL_TYPE_NAMES = {"fp8": "*fp8e4nv"}


def resources(dtype: str, group: int, block_m: int, block_n: int, num_warps: int,
              num_stages: int, precision: str) -> str:
    """One configuration compiled for sm_90, as a line of its resource use."""
    fn = _prefill_kernel
    # strides and block_size; compile_sm90 marks the constants' names constexpr
    signature = {name: "i32" for name in fn.arg_names}
    for name in ("q_ptr", "out_ptr"):
        signature[name] = TYPE_NAMES[dtype]
    for name in ("k_cache_ptr", "v_cache_ptr"):
        signature[name] = POOL_TYPE_NAMES.get(dtype, TYPE_NAMES[dtype])
    for name in ("block_tables_ptr", "query_start_loc_ptr", "context_lens_ptr"):
        signature[name] = "*i32"
    signature["scale_log2"] = "fp32"
    signature["scales_ptr"] = "*fp32"
    group_pad = triton.next_power_of_2(group)
    constants = dict(
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=HEAD_DIM, BLOCK_Q=max(1, block_m // group_pad),
        BLOCK_N=block_n, BLOCK_D=HEAD_DIM, NUM_STAGES=num_stages, DOT_PRECISION=precision,
        TILES_OUTER=True, QUANTIZE=dtype in POOL_TYPE_NAMES,
    )  # fmt: skip
    report = compile_sm90(fn, signature, constants, num_warps=num_warps, num_stages=num_stages)
    return (
        f"{dtype} group {group} M{block_m} N{block_n} warps {num_warps} stages {num_stages} "
        f"{precision}: shared {report.shared} B, registers {report.registers}, "
        f"spilled (local) {report.spilled} B, wgmma {report.count('HGMMA')}"
    )


def default_configs() -> list[tuple]:
    """``LAUNCH`` and ``LONG_RUN_LAUNCH`` for bf16, fp32 and bf16 queries over an e4m3
    pool at the 0.6B (group 2) and 8B (group 4) shapes."""
    out = []
    for table in (LAUNCH, LONG_RUN_LAUNCH):
        for name, dtype in DTYPES.items():
            launch = table[dtype]
            for group in (2, 4):
                out.append((name, group, launch.block_m, launch.block_n, launch.num_warps,
                            launch.num_stages, launch.dot_precision))  # fmt: skip
    return out


def parse(arg: str) -> tuple:
    """``dtype,group,block_m,block_n,warps,stages[,precision]`` (precision from LAUNCH)."""
    parts = arg.split(",")
    precision = parts[6] if len(parts) > 6 else LAUNCH[DTYPES[parts[0]]].dot_precision
    return (parts[0], *map(int, parts[1:6]), precision)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the kernel must be a compiled one, not interpreted")
    configs = [parse(a) for a in sys.argv[1:]] or default_configs()
    for config in configs:
        try:
            print(resources(*config))
        except Exception as err:  # noqa: BLE001 (report and go on to the next one)
            print(f"{config}: FAILED {type(err).__name__}: {str(err)[:300]}")


if __name__ == "__main__":
    main()
