"""The runner: one tensor-parallel rank's model, backends, pools, buffers and graphs.

It computes what the engine schedules and never decides who runs. One runner per
tensor-parallel rank, assembled from parts that own their state:

- :class:`~kvrunner.runner.weight_store.WeightStore`: the weights, where they are,
  and what is still to push;
- :class:`~kvrunner.runner.pools.cache_pools.CachePools`: every backend's pools, at the
  group's one size;
- :class:`~kvrunner.runner.capture.graph_capture.GraphCapture`: the decode graphs;
- :class:`~kvrunner.runner.step_launch.StepLauncher`: one step, up to its samples;
- :class:`~kvrunner.runner.sleep_wake.SleepWake`: sleep and wake of the three above.

The runner itself loads the model, builds the backends (:func:`build_backends`) and
the persistent buffers, and sizes the pools once (:attr:`ModelRunner.pool_size`). It
runs steps and captures; the rank calls reach every other part directly
(``runner.sleep_wake``, ``runner.weights``, ``runner.cache``, ``runner.graph_capture``,
``runner.launcher``).
"""

from __future__ import annotations

import math

import attrs
import torch

from kvrunner.config import ConfigError, EngineConfig
from kvrunner.distributed.group import DistGroup
from kvrunner.engine.step_io import PackedSampled, StepInput
from kvrunner.errors import SleepStateError
from kvrunner.layers.determinism import choose_determinism
from kvrunner.layers.expert_routes import RoutesPool
from kvrunner.layers.fp8.choice import building_with, resolve_quantization
from kvrunner.layers.fused.dispatch import choose_kernels
from kvrunner.layers.linear import SINGLE
from kvrunner.layers.numerics import choose_numerics
from kvrunner.layers.sampler import Sampler
from kvrunner.plugin_api.overlap import LayerStack, OverlapContext
from kvrunner.plugin_api.step_data import BackendContext, ForwardContext, ModelSpec
from kvrunner.plugin_host.backend_manager import BackendManager
from kvrunner.runner.capture.graph_capture import GraphCapture
from kvrunner.runner.model_len import fit_model_len, min_pool_blocks, model_len_bound
from kvrunner.runner.pools.cache_pools import CachePools
from kvrunner.runner.pools.pool_size import OwnSize, PoolSize, agree_pool_size
from kvrunner.runner.pools.sizing import (
    cache_budget_bytes,
    num_blocks_for_budget,
    release_unreachable_memory,
)
from kvrunner.runner.routes_backend import (
    ROUTES_BACKEND,
    attach_route_recorders,
    routes_backend,
    routes_pool,
)
from kvrunner.runner.setup import (
    resolve_device,
    resolve_dtype,
    resolve_max_num_batched_tokens,
    resolve_model_path,
)
from kvrunner.runner.sleep_wake import SleepWake
from kvrunner.runner.step.forward_vars import ForwardVars
from kvrunner.runner.step.launched_step import LaunchedStep
from kvrunner.runner.step.step_audit import StepAudit
from kvrunner.runner.step.step_batch import profile_step
from kvrunner.runner.step.step_metadata import StepMetadataBuilder
from kvrunner.runner.step_launch import StepLauncher
from kvrunner.runner.weight_store import WeightStore


def _create_library_workspaces(device: torch.device, dtype: torch.dtype) -> None:
    """Make cuBLAS / cuBLASLt allocate their workspaces now, before any weight.

    They are allocated lazily, through the caching allocator, and live for the whole
    process; made after the weights, one can land in the unused tail of a weight's
    segment, and a level-2 sleep could then never return that segment (the embedding's
    is over a GiB at the 8B shape) to the device.
    """
    x = torch.ones(8, 8, device=device, dtype=dtype)
    torch.nn.functional.linear(x, x, x[0])  # cuBLASLt (matmul with bias)
    torch.mm(x, x)  # cuBLAS


def _all_reduce_for(config: EngineConfig) -> str:
    """The all-reduce the layers use. With an overlap plugin, two micro-batches'
    all-reduces may run at once; the symmetric-memory one has a single buffer."""
    asked = config.parallel.all_reduce
    if config.backends.overlap == "none":
        return asked
    if asked == "symm_mem":
        raise ConfigError(
            f"all_reduce='symm_mem' cannot run under overlap={config.backends.overlap!r}: "
            f"two micro-batches would share its one buffer; use all_reduce='auto' or 'nccl'"
        )
    return "nccl" if asked == "auto" else asked


def build_backends(
    config: EngineConfig, spec: ModelSpec, *, dtype: torch.dtype, device: torch.device,
    max_tokens: int, routes: RoutesPool | None = None,
) -> BackendManager:
    """The backend manager of one rank: the backend each layer type is configured
    for, each given the context of its layers, the overlap plugin, if any, and with
    ``enable_return_routed_experts`` the core's routes backend.

    :param max_tokens: the rank's token buffers' size (at least ``max_num_seqs``).
    :param routes: the routed-experts pool the core's routes backend fills (None: no
        route is recorded).
    """
    sched = config.scheduler
    use_triton = device.type == "cuda" or config.kernels.triton_on_cpu
    selection = {t: config.backends.for_layer_type(t) for t in sorted(set(spec.layer_types))}

    def context_for(name: str, layer_types: tuple[str, ...]) -> BackendContext:
        layers = tuple(i for i, t in enumerate(spec.layer_types) if t in layer_types)
        return BackendContext(
            name=name,
            layers=layers,
            model=spec,
            dtype=dtype,
            device=device,
            block_size=config.cache.block_size,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=max_tokens,
            max_model_len=sched.max_model_len,
            use_triton=use_triton,
            options=config.kernels.options_for(name),
            deterministic=config.deterministic,
            kv_cache_dtype=config.cache.kv_cache_dtype,
            calculate_kv_scales=config.cache.calculate_kv_scales,
        )

    core_backends = {} if routes is None else {ROUTES_BACKEND: routes_backend(routes)}
    overlap = config.backends.overlap
    return BackendManager(
        selection, context_for, core_backends=core_backends,
        overlap=None if overlap == "none" else OverlapContext(
            name=overlap, device=device, max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=max_tokens,
            tensor_parallel_size=config.parallel.tensor_parallel_size,
            min_tokens=config.backends.overlap_min_tokens,
            min_decode_seqs=config.backends.overlap_min_decode_seqs,
        ),
    )


class ModelRunner:
    """One rank's runner.

    :param group: this rank's tensor-parallel group (``None`` for a single rank);
        its size must be ``config.parallel.tensor_parallel_size``.
    """

    def __init__(
        self, config: EngineConfig, *, progress: bool = False, group: DistGroup | None = None
    ) -> None:
        from kvrunner.models.loader import (
            check_model_len,
            load_hf_config,
            load_model,
            max_positions,
            model_spec,
            parse_config,
        )

        tp_size = config.parallel.tensor_parallel_size
        if (group.size if group is not None else 1) != tp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size} but the runner was given a group of "
                f"{group.size if group is not None else 1}; build it through an executor "
                f"(kvrunner.runner.ranks.executor.make_executor)"
            )
        self.progress = progress
        self.group = group
        self.device = resolve_device(config.device)
        #: what this process held on the device before this engine allocated anything
        #: (another engine's pool, a colocated trainer's tensors): not this engine's
        self._held_before = (torch.cuda.memory_allocated(self.device)
                             if self.device.type == "cuda" else 0)
        self.model_path = resolve_model_path(config.model)
        hf_config = load_hf_config(self.model_path)
        self.dtype = resolve_dtype(config.dtype, self.device, hf_config)
        self.spec: ModelSpec = model_spec(hf_config, tp_size=config.parallel.tensor_parallel_size)
        check_model_len(config.scheduler.max_model_len, hf_config)  # before any weight loads
        # An unset max_model_len: buffers and backends are built for the model's bound,
        # and the pool may lower it once sized (self.model_len, below).
        self._asked_model_len = config.scheduler.max_model_len
        self._max_positions = max_positions(hf_config)
        config = attrs.evolve(config, scheduler=attrs.evolve(
            config.scheduler,
            max_model_len=model_len_bound(self._asked_model_len, self._max_positions),
        ))
        self.config = config
        sched = config.scheduler
        self.max_batch = sched.max_num_seqs
        #: the step budget the engine's scheduler is built on (reported to the driver)
        self.max_num_batched_tokens = resolve_max_num_batched_tokens(
            sched.max_num_batched_tokens, self.device
        )
        self.max_tokens = max(self.max_num_batched_tokens, sched.max_num_seqs)
        self.num_slots = sched.max_num_seqs + 1  # the last slot is a scratch slot
        #: "fp8" or None: the projections' weight storage (``layers/fp8/``); judged
        #: before the process-wide choices below, so a refused config changes none
        self.quantization = resolve_quantization(config.quantization, hf_config,
                                                 deterministic=config.deterministic)
        # The layers' kernel choices are the process's: this rank's config sets them
        # before anything is built that asks (the backends, the graphs' sampling).
        choose_kernels(config.kernels)
        choose_determinism(config.deterministic, self.device)
        #: each token's routed experts by KV slot (``enable_return_routed_experts``)
        self.routes = (
            routes_pool(parse_config(hf_config)[1], config, self.device)
            if config.enable_return_routed_experts else None
        )
        self.backends = build_backends(
            config, self.spec, dtype=self.dtype, device=self.device, max_tokens=self.max_tokens,
            routes=self.routes,
        )
        if self.device.type == "cuda":
            _create_library_workspaces(self.device, self.dtype)
        with building_with(self.quantization):
            self.model, self.tokenizer, self.model_config = load_model(
                self.model_path,
                dtype=self.dtype,
                device=self.device,
                progress=progress,
                load_format=config.load_format,
                seed=config.seed,
                skip_tokenizer=config.skip_tokenizer_init,
                check_finite=config.check_finite,
                make_layer=lambda i, t: self.backends.make_layer(layer_index=i, layer_type=t),
                tp=(
                    group.tp_group(dtype=self.dtype, all_reduce=_all_reduce_for(config),
                                   fixed_order=config.deterministic)
                    if group is not None
                    else SINGLE
                ),
            )
        choose_numerics(self.model, fp32_lm_head=config.fp32_lm_head,
                        fp32_router_logits=config.fp32_router_logits)
        if self.routes is not None:
            attach_route_recorders(self.model, self.routes)
        # On CUDA this moves the weights into an allocator pool of their own, so a
        # level-2 sleep returns their segments whatever else the process holds; before
        # the sizing below, which must see the memory the move leaves.
        self.weights = WeightStore(self.model, self.device, self.dtype)
        #: the model as an overlap plugin drives it, layer by layer
        self.layer_stack = LayerStack.of(self.model.model)
        self.forward_vars = ForwardVars()
        self.forward_vars.register(
            "input_ids", torch.zeros(self.max_tokens, dtype=torch.int64, device=self.device)
        )
        #: the shared read side of every step (positions included), built once per step
        self.step_builder = StepMetadataBuilder(
            max_batch=self.max_batch,
            max_tokens=self.max_tokens,
            max_blocks_per_seq=math.ceil(sched.max_model_len / config.cache.block_size),
            device=self.device,
        )
        self.forward_vars.register_all(self.step_builder.buffers())
        self.forward_vars.register_all(
            self.backends.persistent_buffers(max_batch=self.max_batch, max_tokens=self.max_tokens)
        )
        self.graph_capture = GraphCapture(
            config.capture, max_batch=self.max_batch, backends=self.backends,
            forward_vars=self.forward_vars, step_builder=self.step_builder,
            device=self.device, vocab_size=self.model_config.vocab_size,
        )
        # Only the first rank draws tokens: the engine sends the tokens each step
        # feeds, so the other ranks never need what was sampled - except with
        # asynchronous steps, whose next step feeds them before the engine knows them:
        # then rank 0 broadcasts them on the device (one small collective per step).
        samples = group is None or group.rank == 0
        self.launcher = StepLauncher(
            block_size=config.cache.block_size, device=self.device, group=group,
            model=self.model, backends=self.backends, forward_vars=self.forward_vars,
            step_builder=self.step_builder, graphs=self.graph_capture,
            sampler=Sampler(config.seed, config.logprobs_mode),
            # looked up at each call: a benchmark may swap the runner's forward
            forward_rows=lambda n, ctx: self._forward_rows(n, ctx),
            samples=samples,
            shares_samples=(
                group is not None and group.size > 1 and config.scheduler.async_scheduling
            ),
            max_num_seqs=sched.max_num_seqs, vocab_size=self.model_config.vocab_size,
            routes=self.routes,
        )
        #: the group's one pool size: every rank allocates it, the engine's block
        #: manager holds it, a wake restores it
        self.pool_size: PoolSize = agree_pool_size(self._own_pool_size, group,
                                                   num_slots=self.num_slots)
        #: the max_model_len the engine serves, and why (the group's one pool size
        #: fixes it, so every rank resolves the same)
        self.model_len = fit_model_len(
            self._asked_model_len, self._max_positions,
            num_blocks=self.pool_size.num_blocks, block_size=config.cache.block_size,
        )
        self.config = attrs.evolve(config, scheduler=attrs.evolve(
            config.scheduler, max_model_len=self.model_len.value
        ))
        self.cache = CachePools(self.backends, self.pool_size)
        if config.capture.audit:
            self.launcher.audit = StepAudit(
                backends=self.backends, pools=lambda: self.cache.pools,
                core_buffers={"input_ids": self.forward_vars["input_ids"],
                              **self.step_builder.buffers()},
                block_size=config.cache.block_size,
            )
        self.sleep_wake = SleepWake(
            config=self.config, device=self.device, group=group, cache=self.cache,
            weights=self.weights, graphs=self.graph_capture, capture=self.capture,
        )
        if not config.capture.enforce_eager:
            self.capture()
        self.progress = False  # bars while starting up; recaptures stay quiet

    # -- sizing ------------------------------------------------------------------------

    def _own_pool_size(self) -> OwnSize:
        """What this rank alone can hold: the configured count, or its budget after the
        profiled activation peak (CUDA)."""
        cache = self.config.cache
        if cache.num_blocks is not None:
            return OwnSize(num_blocks=cache.num_blocks)
        peak = 0
        if self.device.type == "cuda":
            release_unreachable_memory(self.device)  # before the profile and the budget
            peak = self._profile_peak_bytes()
        blocks = num_blocks_for_budget(
            list(self.backends.cache_specs().values()),
            budget_bytes=cache_budget_bytes(cache, self.device, peak_bytes=peak,
                                            held_before=self._held_before),
            num_slots=self.num_slots,
            min_blocks=min_pool_blocks(self._asked_model_len, cache.block_size),
        )
        return OwnSize(num_blocks=blocks, activation_peak_bytes=peak)

    def _profile_peak_bytes(self) -> int:
        """Activation peak of the largest prefill this config allows.

        Runs a real step through the backends over a temporary minimal pool, which is
        released afterwards, so the peak includes every kernel's workspace.
        """
        # The profile's longest row is min(max_model_len - 1, max_tokens) tokens long.
        longest = min(self.config.scheduler.max_model_len, self.max_tokens)
        min_blocks = math.ceil(longest / self.config.cache.block_size)
        with CachePools.profile(self.backends, num_blocks=min_blocks, num_slots=self.num_slots):
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            # Marked, so no backend learns anything (FP8 scales) from its placeholder tokens.
            self.step_builder.profiling = True
            try:
                self.execute(profile_step(self.config, num_tokens=self.max_tokens,
                                          scratch_slot=self.num_slots - 1))
            finally:
                self.step_builder.profiling = False
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        return peak

    # -- steps -------------------------------------------------------------------------

    def execute(self, step: StepInput) -> PackedSampled:
        """Run one step; its sampled tokens as columns (none on ranks > 0, and none
        for a step whose chunks are all mid-prefill)."""
        return self.launcher.launch(step).result()

    def launch(self, step: StepInput) -> LaunchedStep:
        """Run one step up to its samples, leaving them on the device."""
        return self.launcher.launch(step)

    def _forward_rows(self, num_rows: int, ctx: ForwardContext) -> torch.Tensor:
        fv = self.forward_vars
        if ctx.micro_batches:
            assert self.backends.overlap is not None
            return self.backends.overlap.forward(
                self.layer_stack, ctx.micro_batches, fv["input_ids"][:num_rows]
            )
        return self.model(fv["input_ids"][:num_rows], fv["positions"][:num_rows], ctx)

    # -- capture ---------------------------------------------------------------------

    def capture(self) -> float:
        """(Re)capture every decode graph; safe whatever forward_vars hold now."""
        if not self.cache.resident or self.weights.state != "resident":
            raise SleepStateError("cannot capture while asleep: wake_up() first")
        self.launcher.before_capture()
        return self.graph_capture.capture(
            self.launcher.decode_outputs, pools=self.cache.pools,
            # valid as a KV block, a KV slot and a state slot alike
            index_bound=min(self.pool_size.num_blocks, self.num_slots), progress=self.progress,
        )
