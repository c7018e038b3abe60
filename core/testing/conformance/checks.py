"""The properties every backend must have, each a function of a rig and a case.

Each check raises :class:`ConformanceError` (an ``AssertionError``) saying what
the backend did wrong. Hypothesis drives them over :func:`~.cases.step_cases`
(see :func:`kvrunner.testing.conformance.run_check`).
"""

from __future__ import annotations

import torch

from kvrunner.config import CaptureConfig
from kvrunner.plugin_api.errors import BackendError
from kvrunner.plugin_api.mirroring import map_tensors, unwalked_tensors
from kvrunner.plugin_api.step_data import ForwardContext
from kvrunner.plugin_host.backend_manager import require_promised_bytes
from kvrunner.runner.capture.capture import capture_decode_graphs
from kvrunner.runner.capture.capture_safety import CaptureAuditError
from kvrunner.runner.pools.pool_release import PoolRelease
from kvrunner.runner.pools.pool_rows import pool_rows
from kvrunner.testing.conformance import cases, reference
from kvrunner.testing.conformance.batch_invariance import probe_bits_match_alone
from kvrunner.testing.conformance.cases import StepCase
from kvrunner.testing.conformance.errors import ConformanceError
from kvrunner.testing.conformance.rig import FULL, Rig, Rows, live_rows, run_layer
from kvrunner.testing.host_reads import HostReadError, forbid_host_reads


def expected(rig: Rig, rows: Rows, layer: int) -> torch.Tensor:
    """The reference output of ``layer`` for these rows (CPU, fp32)."""
    parts = []
    for seq, start, end in rows:
        inputs = rig.seq_inputs(seq, layer)
        if rig.target.layer_type == FULL:
            q, k, v = inputs
            if rig.target.kv_cache_dtype == "fp8":
                k, v = reference.e4m3(k), reference.e4m3(v)
            positions = range(start, end)
            parts.append(reference.full_attention(q[start:end], k[:end], v[:end], positions))
        else:
            mixed, g, beta = (t[:end] for t in inputs)
            weight, bias = rig.conv_params(layer)
            s = rig.spec
            out = reference.gated_delta_rule(
                mixed, g, beta, weight, bias, num_key_heads=s.linear_num_key_heads,
                head_k_dim=s.linear_key_head_dim, num_value_heads=s.linear_num_value_heads,
                head_v_dim=s.linear_value_head_dim,
            )  # fmt: skip
            parts.append(out[start:end])
    return torch.cat(parts)


def _require_matches(rig: Rig, rows: Rows, outputs: dict[int, torch.Tensor], what: str) -> None:
    tokens = sum(end - start for _, start, end in rows)
    for layer, out in outputs.items():
        if not torch.isfinite(out).all():
            raise ConformanceError(f"{what}: layer {layer} output holds NaN/inf (read a row "
                                   f"it never wrote, or a padded row read something)")
        want = expected(rig, rows, layer)
        try:
            torch.testing.assert_close(out[:tokens].float(), want, rtol=1e-3, atol=1e-4)
        except AssertionError as e:
            raise ConformanceError(
                f"{what}: layer {layer} differs from the reference:\n{e}"
            ) from None


def _require_only(rig: Rig, before: dict, rows: Rows, what: str) -> None:
    """Every pool row outside the live rows is byte-identical to ``before``."""
    live = live_rows(rows)
    after = rig.rows()
    for name, (kind, old) in before.items():
        new = after[name][1]
        for r in range(old.shape[0]):
            if r in live[kind]:
                continue
            if not torch.equal(old[r].view(torch.uint8), new[r].view(torch.uint8)):
                raise ConformanceError(f"{what}: {kind} row {r} of pool {name} changed; the step "
                                       f"may write only {kind} rows {sorted(live[kind])}")


def _stale_buffers(rig: Rig, seed: int) -> None:
    """Fill every integer buffer the backend owns with in-range row indices, as a bigger
    earlier step might leave them; the step under test must overwrite what it uses."""
    gen = torch.Generator().manual_seed(seed)
    targets = [t.buffer for t in rig.manager.cache_write_targets()]
    for buffer in [*rig.buffers.values(), *targets]:
        if not buffer.is_floating_point() and buffer.dtype != torch.bool:
            values = torch.randint(0, rig.pools_bound(), buffer.shape, generator=gen)
            buffer.copy_(values.to(buffer.dtype))


def step_matches_reference(rig: Rig, case: StepCase) -> None:
    """Every step of the case, the final one included, equals the naive reference."""
    for rows in case.history():
        _require_matches(rig, rows, rig.serve(rows), "history step")
    _require_matches(rig, case.final(), rig.serve(case.final()), "final step")


def only_live_rows_change(rig: Rig, case: StepCase) -> None:
    """A step writes only the KV slots of its tokens and the state slots of its sequences."""
    for rows in [*case.history(), case.final()]:
        before = rig.rows()
        rig.serve(rows)
        _require_only(rig, before, rows, "a step")


def pad_rows_write_nothing(rig: Rig, case: StepCase) -> None:
    """A decode padded with PAD rows, over buffers a bigger step left full, writes only
    its real rows."""
    rig.serve_history(case)
    _stale_buffers(rig, case.seed)
    before = rig.rows()
    rig.serve(case.final(), pad_rows=max(case.num_pad_rows, 1))
    _require_only(rig, before, case.final(), "a padded decode")


def write_targets_pad_past_live_rows(rig: Rig, case: StepCase) -> None:
    """After a step, every write target the step filled holds PAD in each row past the
    step's rows. (A target of a path the step does not take, say a prefill-only one in
    a decode, may keep what the last step of its path left: captures blank it, and
    that path's next step refills it.)"""
    rig.serve_history(case)
    _stale_buffers(rig, case.seed)
    stale = [t.buffer.clone() for t in rig.manager.cache_write_targets()]
    step = rig.step(case.final(), padded=len(case.live) + case.num_pad_rows)
    rig.manager.build_metadata(step)
    filled = [t for t, old in zip(rig.manager.cache_write_targets(), stale, strict=True)
              if not torch.equal(t.buffer, old)]
    if stale and not filled:
        raise ConformanceError("build_metadata filled none of the write targets")
    for t in filled:
        tail = t.buffer.reshape(-1)[step.num_tokens :]
        if not tail.eq(t.pad_value).all():
            bad = int(tail.ne(t.pad_value).nonzero()[0]) + step.num_tokens
            raise ConformanceError(f"write target {t.qualified_name}[{bad}] = "
                                   f"{int(t.buffer.reshape(-1)[bad])} after a step of "
                                   f"{step.num_tokens} rows; rows past them must hold PAD")


def capture_metadata_leaves_write_side(rig: Rig, case: StepCase) -> None:
    """``build_capture_metadata`` changes no byte of any write target."""
    rig.serve_history(case)
    rig.serve(case.final())
    gen = torch.Generator().manual_seed(case.seed)
    targets = rig.manager.cache_write_targets()
    for t in targets:
        t.buffer.copy_(torch.randint(-3, 100, t.buffer.shape, generator=gen).to(t.buffer.dtype))
    before = [t.buffer.clone() for t in targets]
    rig.manager.build_capture_metadata(rig.step_builder.fill_capture(len(case.live)))
    for t, old in zip(targets, before, strict=True):
        if not torch.equal(t.buffer, old):
            raise ConformanceError(f"build_capture_metadata rewrote write target "
                                   f"{t.qualified_name}; blanking is the core's job")


def blanked_capture_writes_nothing(rig: Rig, case: StepCase) -> None:
    """After serving, a capture over blanked write targets leaves every pool unchanged."""
    rig.serve_history(case)
    rig.serve(case.final())
    before = {name: pool.clone() for name, pool in rig.pools.items()}
    size = len(case.live) + case.num_pad_rows
    ctx = rig.capture_context(size)
    rows = [(s, 0, 1) for s in case.live]
    for _ in range(2):  # warmup and captured forward
        rig.forward(rows, ctx, pad_rows=case.num_pad_rows)
    for name, pool in rig.pools.items():
        if not torch.equal(pool.view(torch.uint8), before[name].view(torch.uint8)):
            raise ConformanceError(f"a capture over blanked write targets changed pool {name}: "
                                   f"a kernel writes through a buffer not declared in "
                                   f"cache_write_targets")


def replay_sees_later_fill(rig: Rig, case: StepCase) -> None:
    """A forward with the capture-time metadata, run after a real decode step filled the
    buffers (as a replayed graph does), equals the reference and writes only live rows."""
    rig.serve_history(case)
    size = len(case.live) + case.num_pad_rows
    capture_ctx = rig.capture_context(size)
    rig.manager.build_metadata(rig.step(case.final(), padded=size))
    before = rig.rows()
    outputs = rig.forward(case.final(), capture_ctx, pad_rows=case.num_pad_rows)
    _require_matches(rig, case.final(), outputs, "a replay with capture-time metadata")
    _require_only(rig, before, case.final(), "a replay with capture-time metadata")


def _capture_under_audit(rig: Rig, case: StepCase) -> None:
    """The core's own capture loop, audit on, over a forward of the served layers.

    The inputs are made once, before the loop: on CUDA the forward is captured into a
    real graph, where no host-to-device copy may happen.
    """
    sizes = [1, 2, 4]
    inputs = {i: rig.layer_inputs([(case.live[0], 0, 1)], i, pad_rows=max(sizes) - 1)
              for i in rig.served}

    def forward(rows: int, ctx: ForwardContext) -> torch.Tensor:
        out = torch.empty(0)
        for i, layer in rig.layers.items():
            per_token, rest = inputs[i][:3], inputs[i][3:]
            out = run_layer(layer, [*[t[:rows] for t in per_token], *rest], ctx)
        return out

    capture_decode_graphs(
        sizes=sizes, backends=rig.manager, forward=forward, forward_vars=rig.forward_vars,
        step_builder=rig.step_builder, pools=rig.pools, config=CaptureConfig(audit=True),
        device=rig.device, index_bound=rig.pools_bound(),
    )  # fmt: skip


def serve_sleep_wake_recapture_under_audit(rig: Rig, case: StepCase) -> None:
    """Serve, release and re-allocate the pools (sleep/wake), recapture under the audit
    (undeclared index buffers seeded, as serving leaves them), then serve again: the
    audit passes, and the new pools are the ones the kernels write."""
    rig.serve_history(case)
    rig.serve(case.final())
    rig.manager.release_cache()
    rig.allocate()
    try:
        _capture_under_audit(rig, case)
    except CaptureAuditError as e:
        raise ConformanceError(f"the capture audit after serving and a wake failed: {e}") from None
    rows = [(s, 0, s.length) for s in case.live[:2]]  # fits one step's token budget
    before = rig.rows()
    _require_matches(rig, rows, rig.serve(rows), "a step after a wake")
    after = rig.rows()
    for name, (kind, old) in before.items():
        wanted = live_rows(rows)[kind]
        new = after[name][1]
        if wanted and all(torch.equal(old[r].view(torch.uint8), new[r].view(torch.uint8))
                          for r in wanted):
            raise ConformanceError(f"after a wake a step wrote none of its {kind} rows into "
                                   f"pool {name}, which allocate_cache returned: a layer kept "
                                   f"the pools of the first allocation")


def release_cache_frees_the_pools(rig: Rig, case: StepCase) -> None:
    """After serving, ``release_cache`` lets the storage of every pool ``allocate_cache``
    returned go (a sleep checks the same), and the pools can be allocated again."""
    rig.serve_history(case)
    release = PoolRelease(rig.pools)
    rig.pools = {}
    rig.manager.release_cache()
    try:
        release.require_released()
    except BackendError as e:
        raise ConformanceError(str(e)) from None
    rig.allocate()


def forward_reads_nothing_on_the_host(rig: Rig, case: StepCase) -> None:
    """On the path a CUDA step takes (the backend's Triton kernels), no layer's forward
    reads a tensor's value on the host: no ``item()``, ``int()`` / ``bool()`` of a tensor,
    index by a 0-dim tensor, ``tolist()``, or shape that depends on the values. On CUDA
    each one makes the host wait for the device, which asynchronous steps cannot
    afford, and fails a graph capture."""
    steps = [(rows, 0) for rows in [*case.history(), case.final()]]
    if case.final_is_decode:
        steps.append((case.final(), max(case.num_pad_rows, 1)))  # a padded decode too
    guard = lambda i: forbid_host_reads(f"layer {i}'s forward")  # noqa: E731
    for rows, pad_rows in steps:
        try:
            rig.serve(rows, pad_rows=pad_rows, layer_guard=guard)
        except Exception as e:  # the core names the layer and chains what it raised
            if isinstance(e.__cause__ or e, HostReadError):
                raise ConformanceError(str(e.__cause__ or e)) from None
            raise


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (a NaN equals itself)."""
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                       b.reshape(-1).contiguous().view(torch.uint8))


def _overwrite(tensors: list[torch.Tensor], rig: Rig, seed: int) -> None:
    """Integer tensors get in-range row indices, floating ones NaN: a layer that reads
    any of them writes wrong rows or returns NaN."""
    gen = torch.Generator().manual_seed(seed + 1)
    for t in tensors:
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.copy_(torch.randint(0, rig.pools_bound(), t.shape, generator=gen).to(t.dtype))


def metadata_carries_what_layers_read(rig: Rig, case: StepCase) -> None:
    """For a backend declaring ``supports_overlap``: its layers read nothing but the
    pools from outside the metadata it returns, in containers an overlap plugin walks
    (:mod:`kvrunner.plugin_api.mirroring`). The step's metadata is copied by that walk,
    as an overlap plugin copies a micro-batch's; then every buffer the step filled
    (the core's read side, the backend's buffers, its write targets, and anything on
    its builder that ``build_metadata`` changed) is overwritten, as building the next
    micro-batch overwrites them. A forward with the copy must still equal the
    reference and write only the step's rows."""
    rig.serve_history(case)
    _stale_buffers(rig, case.seed)  # so a buffer the step fills shows a change
    step = rig.step(case.final())
    pools = {p.untyped_storage().data_ptr() for p in rig.pools.values()}
    candidates = [*rig.buffers.values(), *(t.buffer for t in rig.manager.cache_write_targets()),
                  *(t for t in rig.manager.held_tensors().values()
                    if t.untyped_storage().data_ptr() not in pools)]
    before = [t.clone() for t in candidates]
    ctx = rig.manager.build_metadata(step)
    unwalked = unwalked_tensors(ctx, "ctx")
    if unwalked:
        raise ConformanceError(
            f"the metadata holds tensors an overlap plugin cannot mirror: {unwalked}; keep "
            f"them in attrs classes, dataclasses, tuples, lists or dicts"
        )
    copy = map_tensors(ctx, lambda _, t: t.clone())
    filled = [t for t, old in zip(candidates, before, strict=True) if not _same_bytes(t, old)]
    _overwrite([*filled, *rig.step_builder.buffers().values()], rig, case.seed)
    what = ("a forward with a copy of its metadata, after the buffers it was built in were "
            "overwritten (a layer reads a buffer outside the metadata it was handed, so an "
            "overlap plugin's micro-batch would read another's)")
    rows = rig.rows()
    _require_matches(rig, case.final(), rig.forward(case.final(), copy), what)
    _require_only(rig, rows, case.final(), what)


def cache_spec_matches_allocation(rig: Rig, case: StepCase) -> None:
    """The pools ``allocate_cache`` takes are the bytes ``cache_spec`` promised, at the
    kit's size and at another (the runner sizes the pools from the promise)."""
    del case
    specs = rig.manager.cache_specs()
    blocks, slots = cases.NUM_BLOCKS // 2 + 1, cases.NUM_SLOTS + 1
    rig.manager.release_cache()
    try:
        pools = rig.manager.allocate_cache(num_blocks=blocks, num_slots=slots)
        for name, spec in specs.items():
            mine = {k: t for k, t in pools.items() if k.startswith(f"{name}.")}
            require_promised_bytes(name, mine, spec, num_blocks=blocks, num_slots=slots)
        del pools
    except BackendError as e:
        raise ConformanceError(str(e)) from None
    finally:
        rig.manager.release_cache()
        rig.allocate()


def cache_rows_is_a_view(rig: Rig, case: StepCase) -> None:
    """``cache_rows`` hands out a view of each pool (a reader through a copy never sees
    a write), and a step's writes show through it."""
    try:
        rows = pool_rows(rig.pools, {rig.target.name: rig.target.cache_rows})
    except BackendError as e:
        raise ConformanceError(str(e)) from None
    before = [p.rows.clone() for p in rows]
    rig.serve(case.final())
    if all(_same_bytes(p.rows, old) for p, old in zip(rows, before, strict=True)):
        raise ConformanceError("a step wrote its slots, yet no row read through cache_rows "
                               "changed: cache_rows does not read the pools the step writes")


def core_buffers_untouched(rig: Rig, case: StepCase) -> None:
    """``build_metadata`` and the forward leave the core's step buffers (input ids and
    the shared read side: positions, query starts, context lengths, block tables) as
    the core filled them: every backend and the model read them."""
    core = {"input_ids": rig.forward_vars["input_ids"], **rig.step_builder.buffers()}
    for rows in [*case.history(), case.final()]:
        step = rig.step(rows)
        copies = {name: t.clone() for name, t in core.items()}
        ctx = rig.manager.build_metadata(step)
        _require_unchanged(core, copies, "build_metadata")
        rig.forward(rows, ctx)
        _require_unchanged(core, copies, "the forward")


def _require_unchanged(core: dict[str, torch.Tensor], copies: dict[str, torch.Tensor],
                       where: str) -> None:
    changed = [n for n, t in core.items() if not torch.equal(t, copies[n])]
    if changed:
        raise ConformanceError(f"{where} wrote the core's step buffer(s) {changed}; a "
                               f"backend only reads them")


def write_targets_keep_identity(rig: Rig, case: StepCase) -> None:
    """Every write target is the same tensor (address, shape, strides, dtype) at every
    call: captured graphs and blanking hold the first by address."""
    def identities() -> dict[str, tuple]:
        return {t.qualified_name: (t.buffer.data_ptr(), tuple(t.buffer.shape),
                                   t.buffer.stride(), t.buffer.dtype)
                for t in rig.manager.cache_write_targets()}

    try:
        first = identities()
        for rows in [*case.history(), case.final()]:
            rig.serve(rows)
            if identities() != first:
                raise ConformanceError("a write target is a new tensor under an old name "
                                       "after a step; refill it in place instead")
    except BackendError as e:
        raise ConformanceError(str(e)) from None


#: every check, by name, in the order they are documented
CHECKS = {
    fn.__name__: fn
    for fn in (
        step_matches_reference,
        cache_spec_matches_allocation,
        cache_rows_is_a_view,
        only_live_rows_change,
        core_buffers_untouched,
        write_targets_keep_identity,
        pad_rows_write_nothing,
        write_targets_pad_past_live_rows,
        capture_metadata_leaves_write_side,
        blanked_capture_writes_nothing,
        replay_sees_later_fill,
        serve_sleep_wake_recapture_under_audit,
        release_cache_frees_the_pools,
        forward_reads_nothing_on_the_host,
        metadata_carries_what_layers_read,
        probe_bits_match_alone,
    )
}
#: checks of the path a CUDA step takes: they run on targets with ``use_triton`` only
#: (the torch paths are the CPU's, eager by design: they read sizes on the host)
GPU_PATH_ONLY = frozenset({"forward_reads_nothing_on_the_host"})
#: checks of the ``supports_overlap`` promise: they run on backends that declare it
OVERLAP_PROMISE = frozenset({"metadata_carries_what_layers_read"})
#: checks of the ``batch_invariant`` promise: they run on backends that declare it
BATCH_INVARIANCE_PROMISE = frozenset({"probe_bits_match_alone"})
#: checks that drive a whole engine over the kit's tiny model, ``fn(target, case)``
#: over :func:`~.probes.probe_cases` (the others drive a rig: ``fn(rig, case)`` over
#: :func:`~.cases.step_cases`)
ENGINE_CHECKS = frozenset({"probe_bits_match_alone"})
#: checks whose final step must be a decode (they capture or pad)
DECODE_ONLY = frozenset(
    {"pad_rows_write_nothing", "blanked_capture_writes_nothing", "replay_sees_later_fill"}
)
