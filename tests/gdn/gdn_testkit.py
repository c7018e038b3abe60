"""Shared pieces of the GDN tests: random batches with state-index maps, inputs, checks.

A *case* is a batch of 1-4 sequences, each with a length, a slot drawn from a
shuffled slot list, and a role:

- ``fresh``: starts at position 0 (read PAD, write its slot);
- ``cont``: continues from its slot (read = write = slot);
- ``fork``: continues from another, otherwise unused slot (read A, write B);
- ``pad``: a padded row (write PAD): reads nothing, writes nothing, outputs zeros.
"""

from __future__ import annotations

import attrs
import torch
from hypothesis import strategies as st

from kvrunner.config import KernelsConfig
from kvrunner.plugin_api import BackendContext, ModelSpec, StepBatch, StepMetadata
from kvrunner.plugin_api.step_data import pad_block_tables
from kvrunner.plugin_host.backend_manager import BackendManager
from kvrunner.runner.step.step_metadata import StepMetadataBuilder
from kvrunner.testing.host_reads import allow_host_reads
from kvrunner_gdn.ops.gated_delta_rule.inputs import GatedDeltaRuleInputs
from kvrunner_gdn.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

PAD = -1
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROLES = ("fresh", "cont", "fork", "pad")
#: fp32 kernels against the fp32 oracle: reassociation error only (~1e-7), so a
#: relative RMS of 1e-4 is loose enough for any order of summation and far below
#: what any wrong term would give.
TOL = 1e-4


def delta_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, state: torch.Tensor, read: torch.Tensor,
                 write: torch.Tensor, scale: float, **rest) -> GatedDeltaRuleInputs:
    """One step's gated-delta-rule record from the tensors in their usual order."""
    return GatedDeltaRuleInputs(q=q, k=k, v=v, g=g, beta=beta, state=state, read_indices=read,
                                write_indices=write, scale=scale, **rest)


@attrs.frozen
class Case:
    lens: tuple[int, ...]
    read: tuple[int, ...]
    write: tuple[int, ...]
    num_slots: int
    seed: int

    @property
    def num_seqs(self) -> int:
        return len(self.lens)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        cu = [0]
        for n in self.lens:
            cu.append(cu[-1] + n)
        return torch.tensor(cu, dtype=torch.int32, device=DEVICE)

    def indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        as_t = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)
        return as_t(self.read), as_t(self.write)

    @property
    def written(self) -> set[int]:
        return {w for w in self.write if w >= 0}


@st.composite
def cases(draw: st.DrawFn, max_len: int = 1, num_slots: int = 8) -> Case:
    """A batch of 1-4 sequences of lengths 1..max_len with a random state-index map."""
    n = draw(st.integers(1, 4))
    lens = tuple(draw(st.integers(1, max_len)) for _ in range(n))
    slots = draw(st.permutations(range(num_slots)))
    spare = list(slots[n:])  # slots nobody writes this step: the only safe fork sources
    read, write = [], []
    for i in range(n):
        role = draw(st.sampled_from(ROLES))
        if role == "fork" and not spare:
            role = "cont"
        write.append(PAD if role == "pad" else slots[i])
        if role == "cont":
            read.append(slots[i])
        elif role == "fork":
            read.append(spare.pop())
        else:  # fresh and pad rows read nothing (a pad row's read side is arbitrary)
            read.append(PAD if role == "fresh" else draw(st.sampled_from((PAD, slots[i]))))
    return Case(tuple(lens), tuple(read), tuple(write), num_slots, draw(st.integers(0, 2**31)))


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative RMS error; 0 for two zero tensors."""
    a, e = actual.double().cpu(), expected.double().cpu()
    denom = e.pow(2).mean().sqrt().item()
    err = (a - e).pow(2).mean().sqrt().item()
    return err / denom if denom > 0 else err


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN when their bits match)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def poison_fresh_slots(pool: torch.Tensor, case: Case) -> None:
    """NaN-fill the slot of every fresh row: none of it may leak into any output or state."""
    for r, w in zip(case.read, case.write, strict=True):
        if r < 0 and w >= 0:
            pool[w] = float("nan")


def assert_untouched(before: torch.Tensor, after: torch.Tensor, case: Case) -> None:
    """Every slot the step does not write is byte-identical afterwards."""
    for slot in range(case.num_slots):
        if slot not in case.written:
            assert same_bytes(before[slot], after[slot]), f"slot {slot} changed without a write"


def seq_rows(case: Case, i: int) -> slice:
    start = sum(case.lens[:i])
    return slice(start, start + case.lens[i])


@attrs.frozen
class Heads:
    hk: int
    hv: int
    dk: int
    dv: int


heads = st.builds(
    lambda hk, group, dk, dv: Heads(hk, hk * group, dk, dv),
    st.sampled_from((1, 2)),
    st.sampled_from((1, 2)),
    st.sampled_from((8, 16)),
    st.sampled_from((8, 16)),
)


def qkvgb(h: Heads, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random q, k [T, Hk, K], v [T, Hv, V], g [T, Hv] (<= 0, float32), beta [T, Hv]."""
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k, v = r(tokens, h.hk, h.dk), r(tokens, h.hk, h.dk), r(tokens, h.hv, h.dv)
    # Per-head decay strength log-uniform over 1e-3..3 per token: weak heads keep
    # long-range terms inside a chunk significant, strong heads test underflow.
    strength = 10 ** (torch.rand(h.hv, generator=gen) * 3.5 - 3)
    g = -torch.rand(tokens, h.hv, generator=gen) * strength
    beta = torch.rand(tokens, h.hv, generator=gen)
    return tuple(x.to(DEVICE) for x in (q, k, v, g, beta))


#: the core's shared step metadata, as the runner builds it (one per test process)
STEP_BUILDER = StepMetadataBuilder(max_batch=8, max_tokens=256, max_blocks_per_seq=16,
                                   device=DEVICE)


def step_metadata(
    query_lens: list[int], starts: list[int], slots: list[int], num_padded: int | None = None
) -> StepMetadata:
    """The core's metadata for a step, as the runner would hand it to build_metadata."""
    n = len(query_lens)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
    ql, sp = i32(query_lens), i32(starts)
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = ql.cumsum(0)
    positions = [p for s, q in zip(starts, query_lens, strict=True) for p in range(s, s + q)]
    return STEP_BUILDER.fill(StepBatch(
        num_seqs=n,
        num_tokens=int(ql.sum()),
        num_padded_seqs=n if num_padded is None else num_padded,
        query_lens=ql,
        start_positions=sp,
        context_lens=sp + ql,
        cu_query_lens=cu,
        block_table_array=pad_block_tables([()] * n),
        slot_mapping=torch.zeros(int(ql.sum()), dtype=torch.int64),
        state_slots=i32(slots),
        positions=torch.tensor(positions, dtype=torch.int64),
    ))


#: A tiny hybrid model: GDN layers 0 and 2, softmax attention in 1 and 3. Value heads
#: are twice the key heads, as in Qwen3-Next.
TINY_MODEL = ModelSpec(
    num_layers=4,
    layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
MAX_SEQS = 4


def make_manager(use_triton: bool, model: ModelSpec = TINY_MODEL, *,
                 kernels: KernelsConfig | None = None) -> BackendManager:
    """A real BackendManager with only ``gdn`` selected (found through its entry point),
    handed the ``[kernels]`` choices addressed to it as a runner hands them."""

    def context_for(name: str, layer_types: tuple[str, ...]) -> BackendContext:
        layers = tuple(i for t in layer_types for i in model.layers_of_type(t))
        return BackendContext(
            name=name, layers=layers, model=model, dtype=torch.float32, device=DEVICE,
            block_size=16, max_num_seqs=MAX_SEQS, max_num_batched_tokens=128,
            max_model_len=256, use_triton=use_triton,
            options=(kernels or KernelsConfig()).options_for(name),
        )

    return BackendManager({"linear_attention": "gdn"}, context_for)


# -- a stand-in for fla on the CPU ------------------------------------------------------


def oracle_in_fla_layout(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, chunk_size, cu_seqlens=None,
                         chunk_indices=None):
    """fla's documented contract for the wrapper's call (``[1, T, ...]`` varlen in,
    per-sequence initial and final states, output in q's dtype), computed by our naive
    oracle. A stand-in on the CPU: it checks the wrapper's layouts and indices, not fla.
    Rows outside every sequence stay NaN, as fla leaves them unwritten."""
    assert q.shape[0] == 1 and output_final_state and chunk_size in (16, 32, 64)
    # Without offsets the batch row is one sequence; without an initial state each
    # sequence starts from zeros (both as fla documents).
    cu = cu_seqlens.tolist() if cu_seqlens is not None else [0, q.shape[1]]
    assert cu_seqlens is None or cu_seqlens.dtype == torch.long
    if initial_state is None:
        initial_state = torch.zeros(len(cu) - 1, *v.shape[2:3], q.shape[-1], v.shape[-1])
    assert initial_state.dtype == torch.float32 and initial_state.shape[0] == len(cu) - 1
    if chunk_indices is not None:  # (sequence, chunk) for every chunk, in order
        expected = [[s, c] for s in range(len(cu) - 1)
                    for c in range(-(-(cu[s + 1] - cu[s]) // chunk_size))]
        assert chunk_indices.tolist() == expected
    out = torch.full(v.shape, float("nan"))
    finals = []
    for s, (lo, hi) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        o, final = naive_recurrent_gated_delta_rule(
            q[0, lo:hi], k[0, lo:hi], v[0, lo:hi], g[0, lo:hi], beta[0, lo:hi], initial_state[s],
            scale, use_qk_l2norm_in_kernel)
        out[0, lo:hi] = o
        finals.append(final)
    return out.to(q.dtype), torch.stack(finals)


def unguarded(kernel):
    """``kernel`` run with host reads allowed: the stand-in is not what is under test."""

    def call(*args, **kwargs):
        with allow_host_reads():
            return kernel(*args, **kwargs)

    return call
