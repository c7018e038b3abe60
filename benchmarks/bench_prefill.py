"""Paged prefill attention vs torch SDPA on the same tokens laid out contiguously.

Causal self-attention of fresh prompts (no cached prefix), at the Qwen3-0.6B (16 query
/ 8 KV heads x 128) and Qwen3-8B (32 / 8 x 128) attention shapes, T = 1k, 4k, 8k tokens
as one sequence and as 8 equal ones, bf16 and fp32. Paged KV: block size 16, block
tables a random permutation of the pool, so every sequence's blocks are scattered.
SDPA gets the same q, k, v as ``[seqs, heads, T / seqs, dim]``: flash attention in bf16,
memory-efficient attention (math if that refuses) in fp32; with ``enable_gqa`` where the
backend takes it, else with K/V repeated to every query head beforehand (untimed).

Prints ms, the ratio ours / SDPA against the 1.3 target, and the causal FLOP floor
(``4 * L^2 / 2 * heads * head_dim`` per sequence of length L, at the peak below).
Both sides are timed the same way: by default each is captured in a CUDA graph and
replayed (``--timer graph``: the GPU's time, which the short cases need, since a
Python launch there costs more than the kernel); ``--timer events`` times eager
calls with CUDA events, the host's launch included.

    python benchmarks/bench_prefill.py                 # every case, one run
    python benchmarks/bench_prefill.py --block-m 64    # try other launch parameters
    python benchmarks/bench_prefill.py --dry-run       # no GPU: cases, floors, layout check
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F
from common import graph_ms, median_ms, rel_err
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvrunner_paged.ops.paged_attention.inputs import PagedAttentionInputs
from kvrunner_paged.ops.paged_attention.prefill import paged_prefill_attention
from kvrunner_paged.ops.paged_attention.prefill_torch import paged_prefill_attention_torch

SHAPES = {"0.6B": (16, 8, 128), "8B": (32, 8, 128)}  # query heads, kv heads, head_dim
TOKENS = (1024, 4096, 8192)
SEQS = (1, 8)
DTYPES = (torch.bfloat16, torch.float32)
#: H200 dense peaks, TFLOP/s: bf16 tensor cores, fp32 on the FMA units (the floor a
#: plain fp32 kernel faces; tf32x3 tensor-core products can beat it)
PEAK_TFLOPS = {torch.bfloat16: 790.0, torch.float32: 60.0}
TARGET = 1.3
NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
BLOCK = 16
#: SDPA backends tried in order for each dtype (the first that runs is timed)
SDPA_ORDER = {
    torch.bfloat16: (SDPBackend.FLASH_ATTENTION,),
    torch.float32: (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
}


@attrs.frozen
class Case:
    """One batch in both layouts: SDPA's ``[seqs, heads, L, dim]`` and the paged pool."""

    q: torch.Tensor  # [seqs, num_heads, L, dim]
    k: torch.Tensor  # [seqs, num_kv_heads, L, dim] (v likewise)
    v: torch.Tensor
    q_tokens: torch.Tensor  # [seqs * L, num_heads, dim]
    k_cache: torch.Tensor  # [num_blocks, BLOCK, num_kv_heads, dim] (v_cache likewise)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [seqs, L / BLOCK] int32, a permutation of the pool
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5

    def inputs(self, seqs: int, max_query_len: int | None = None) -> PagedAttentionInputs:
        """The paged layout as the attention entries take it."""
        return PagedAttentionInputs(
            q=self.q_tokens, k_cache=self.k_cache, v_cache=self.v_cache,
            block_tables=self.block_tables, query_start_loc=self.query_start_loc,
            context_lens=self.context_lens, scale=self.scale, num_seqs=seqs,
            max_query_len=max_query_len,
        )


def causal_flops(seqs: int, seq_len: int, num_heads: int, head_dim: int) -> float:
    """QK^T and PV over the causal half: 2 products x 2 FLOPs x L^2 / 2 x heads x dim."""
    return seqs * 4 * seq_len**2 / 2 * num_heads * head_dim


def build_case(shape: tuple[int, int, int], tokens: int, seqs: int, dtype: torch.dtype,
               device: torch.device, seed: int = 0) -> Case:
    """Random q, k, v for ``seqs`` sequences of ``tokens / seqs``, scattered into blocks."""
    num_heads, num_kv_heads, dim = shape
    seq_len = tokens // seqs
    assert seq_len * seqs == tokens and seq_len % BLOCK == 0, (tokens, seqs)
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(seqs, num_heads, seq_len, dim, device=device, generator=gen).to(dtype)
    k = torch.randn(seqs, num_kv_heads, seq_len, dim, device=device, generator=gen).to(dtype)
    v = torch.randn(seqs, num_kv_heads, seq_len, dim, device=device, generator=gen).to(dtype)
    per_seq = seq_len // BLOCK
    perm = torch.randperm(seqs * per_seq, device=device, generator=gen)
    tables = perm.view(seqs, per_seq).to(torch.int32)
    k_cache = torch.empty(seqs * per_seq, BLOCK, num_kv_heads, dim, device=device, dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    # [seqs, kv_heads, L, dim] -> [seqs, blocks, BLOCK, kv_heads, dim] -> the table's blocks
    k_cache[tables.long()] = k.transpose(1, 2).reshape(seqs, per_seq, BLOCK, num_kv_heads, dim)
    v_cache[tables.long()] = v.transpose(1, 2).reshape(seqs, per_seq, BLOCK, num_kv_heads, dim)
    starts = torch.arange(seqs + 1, device=device, dtype=torch.int32) * seq_len
    return Case(
        q=q, k=k, v=v, q_tokens=q.transpose(1, 2).reshape(tokens, num_heads, dim),
        k_cache=k_cache, v_cache=v_cache, block_tables=tables, query_start_loc=starts,
        context_lens=torch.full((seqs,), seq_len, device=device, dtype=torch.int32),
    )  # fmt: skip


def as_tokens(sdpa_out: torch.Tensor) -> torch.Tensor:
    """SDPA's ``[seqs, heads, L, dim]`` as the paged layout's ``[seqs * L, heads, dim]``."""
    seqs, heads, seq_len, dim = sdpa_out.shape
    return sdpa_out.transpose(1, 2).reshape(seqs * seq_len, heads, dim)


def pick_sdpa(case: Case, dtype: torch.dtype) -> tuple[Callable[[], torch.Tensor], str]:
    """The first SDPA variant that runs: backend order per dtype, native GQA before
    K/V repeated to every query head (built here, outside the timed call)."""
    group = case.q.shape[1] // case.k.shape[1]
    for backend in SDPA_ORDER[dtype]:
        for gqa in (True, False):
            k = case.k if gqa else case.k.repeat_interleave(group, dim=1)
            v = case.v if gqa else case.v.repeat_interleave(group, dim=1)

            def run(k: torch.Tensor = k, v: torch.Tensor = v, backend: SDPBackend = backend,
                    gqa: bool = gqa) -> torch.Tensor:
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(
                        case.q, k, v, is_causal=True, scale=case.scale, enable_gqa=gqa
                    )

            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "backend not available" chatter
                    run()
            except RuntimeError:
                continue
            return run, f"{backend.name.split('_')[0].lower()}{'+gqa' if gqa else ' rep-kv'}"
    raise RuntimeError(f"no SDPA backend of {SDPA_ORDER[dtype]} runs {dtype}")


def run_case(name: str, tokens: int, seqs: int, dtype: torch.dtype, launch: dict,
             timer: Callable[[Callable[[], torch.Tensor]], float] = graph_ms) -> dict:
    shape = SHAPES[name]
    case = build_case(shape, tokens, seqs, dtype, torch.device("cuda"))
    out = torch.empty_like(case.q_tokens)
    inputs = case.inputs(seqs, max_query_len=tokens // seqs)

    def ours() -> torch.Tensor:
        return paged_prefill_attention(inputs=inputs, out=out, **launch)

    sdpa, variant = pick_sdpa(case, dtype)
    err = rel_err(ours(), as_tokens(sdpa()))
    t_ours, t_sdpa = timer(ours), timer(sdpa)
    flops = causal_flops(seqs, tokens // seqs, shape[0], shape[2])
    return dict(ours=t_ours, sdpa=t_sdpa, variant=variant, ratio=t_ours / t_sdpa,
                floor=flops / (PEAK_TFLOPS[dtype] * 1e12) * 1e3,
                tflops=flops / (t_ours * 1e-3) / 1e12, err=err)  # fmt: skip


def dry_run() -> None:
    """No GPU: the cases and their floors, then the two layouts checked against each
    other at a small T on the CPU through the paged backend's torch path."""
    for name, shape in SHAPES.items():
        for tokens in TOKENS:
            for seqs in SEQS:
                flops = causal_flops(seqs, tokens // seqs, shape[0], shape[2])
                floors = "  ".join(
                    f"{NAMES[dt]} floor {flops / (PEAK_TFLOPS[dt] * 1e12) * 1e3:.3f} ms"
                    for dt in DTYPES
                )
                print(f"{name:>5} T{tokens:<5} x{seqs}  {flops / 1e12:.3f} TFLOP  {floors}")
    for name, shape in SHAPES.items():
        for seqs in SEQS:
            case = build_case(shape, 128, seqs, torch.float32, torch.device("cpu"))
            paged = paged_prefill_attention_torch(inputs=case.inputs(seqs))
            sdpa = F.scaled_dot_product_attention(
                case.q, case.k, case.v, is_causal=True, scale=case.scale, enable_gqa=True
            )
            diff = (paged - as_tokens(sdpa)).abs().max().item()
            print(f"layout check {name} T128 x{seqs}: paged torch path vs CPU SDPA: {diff:.1e}")
            assert diff < 1e-4, "the paged pool does not hold the contiguous tokens"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="no GPU: floors + layout check")
    for knob in ("block-m", "block-n", "num-warps", "num-stages"):
        parser.add_argument(f"--{knob}", type=int, help="override the LAUNCH default")
    parser.add_argument("--dot-precision", choices=("ieee", "tf32", "tf32x3"),
                        help="override the LAUNCH default (fp32 inputs only)")
    parser.add_argument("--tiles-outer", type=int, choices=(0, 1),
                        help="override the grid order (1: query tiles outermost)")
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32")
    parser.add_argument("--timer", choices=("graph", "events"), default="graph",
                        help="graph: replayed CUDA graphs (GPU time); events: eager calls")
    args = parser.parse_args()
    if args.dry_run:
        dry_run()
        return
    knobs = ("block_m", "block_n", "num_warps", "num_stages", "dot_precision", "tiles_outer")
    launch = {k: getattr(args, k) for k in knobs}
    launch = {k: v for k, v in launch.items() if v is not None}
    if "tiles_outer" in launch:
        launch["tiles_outer"] = bool(launch["tiles_outer"])
    props = torch.cuda.get_device_properties(0)
    timer = graph_ms if args.timer == "graph" else median_ms
    print(f"{props.name}, {props.multi_processor_count} SMs; launch overrides: {launch or 'none'}; "
          f"timer: {args.timer}")
    print(f"{'model':>5} {'T':>5} {'seqs':>4} {'dtype':>5} {'ours ms':>8} {'SDPA ms':>8} "
          f"{'SDPA':>15} {'ratio':>6} {'floor ms':>8} {'ours TF/s':>9} {'rel err':>8}")  # fmt: skip
    by_name = {name: dt for dt, name in NAMES.items()}
    dtypes = [by_name[n] for n in args.dtypes.split(",")]
    worst: dict[torch.dtype, float] = {}
    missed = 0
    for dtype in dtypes:
        for name in SHAPES:
            for tokens in TOKENS:
                for seqs in SEQS:
                    r = run_case(name, tokens, seqs, dtype, launch, timer)
                    met = r["ratio"] <= TARGET
                    missed += not met
                    worst[dtype] = max(worst.get(dtype, 0.0), r["ratio"])
                    print(
                        f"{name:>5} {tokens:>5} {seqs:>4} {NAMES[dtype]:>5} "
                        f"{r['ours']:>8.3f} {r['sdpa']:>8.3f} {r['variant']:>15} "
                        f"{r['ratio']:>6.2f} {r['floor']:>8.3f} {r['tflops']:>9.1f} "
                        f"{r['err']:>8.1e}  {'met' if met else 'MISSED'}"
                    )
    for dtype, ratio in worst.items():
        print(f"worst ratio {NAMES[dtype]}: {ratio:.2f} (target <= {TARGET})")
    print(f"{missed} of {len(SHAPES) * len(TOKENS) * len(SEQS) * len(dtypes)} cases missed")


if __name__ == "__main__":
    main()
