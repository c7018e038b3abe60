"""The public API, shaped as vLLM users expect: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch
from tqdm.auto import tqdm

from kvrunner.call_guard import exclusive
from kvrunner.config import EngineConfig
from kvrunner.engine.cache_salt import WeightVersion
from kvrunner.engine.grammar_compiler import parse_constraint
from kvrunner.engine.llm_engine import LLMEngine
from kvrunner.errors import RequestError
from kvrunner.held_sigint import SigintAtStepEnd
from kvrunner.outputs import RequestOutput
from kvrunner.prompts import (
    normalize_requests,
    per_prompt_salts,
    prompt_token_ids,
    unpack_prompt,
)
from kvrunner.rl.sleep import SleepWakeControl
from kvrunner.rl.sleep_state import CacheInfo, SleepState
from kvrunner.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvrunner.runner.ranks.executor import DriverExecutor

Prompt = str | Seq[int]


class LLM:
    """Load a model and generate from it.

    Not thread-safe: one engine serves one call at a time, and a call from a second
    thread while one runs raises :class:`~kvrunner.errors.ConcurrentUseError`.

    :param model: an HF-format directory or an embedded default; unset, the config
        file's ``model``, else ``tiny-qwen3``.
    :param dtype: unset, the config file's ``dtype``, else ``auto``.
    :param config_file: a TOML file with ``[cache]``, ``[scheduler]``, ``[backends]``...
    :param config: flat overrides (``block_size=32``, ``full_attention="paged"``);
        ``skip_tokenizer_init=True`` loads no tokenizer (prompts must be token ids).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str | None = None,
        config_file: str | Path | None = None,
        progress: bool = False,
        **config: Any,
    ) -> None:
        from kvrunner.runner.ranks.executor import make_executor

        loaded = EngineConfig.load(config_file, model=model, dtype=dtype, **config)
        # tensor_parallel_size > 1 spawns one process per rank here; shutdown() (or
        # the context manager, or interpreter exit) stops them.
        self._start(loaded, make_executor(loaded, progress=progress))

    @classmethod
    def from_executor(cls, config: EngineConfig, executor: DriverExecutor) -> LLM:
        """An LLM over an executor built elsewhere (torchrun's rank 0: see
        ``kvrunner.launch``)."""
        llm = cls.__new__(cls)
        llm._start(config, executor)
        return llm

    def _start(self, config: EngineConfig, executor: DriverExecutor) -> None:
        # An unset step budget and max_model_len were resolved by the ranks (by device;
        # by the model and the pool): the scheduler and every later check use theirs,
        # and llm.config shows them.
        self.config = attrs.evolve(config, scheduler=attrs.evolve(
            config.scheduler, max_num_batched_tokens=executor.max_num_batched_tokens,
            max_model_len=executor.model_len.value,
        ))
        if executor.model_len.source != "config":  # the engine chose it: say so, once
            print(executor.model_len.line(), file=sys.stderr)
        self.executor = executor
        #: the in-process runner (rank 0's under torchrun); None when ranks are spawned
        self.runner = executor.runner
        info = executor.model_info
        self.tokenizer = info.tokenizer
        self.engine = LLMEngine(
            self.config,
            self.executor,
            eos_token_ids=info.eos_token_ids,
            vocab_size=info.vocab_size,
            uses_state_slots=info.uses_state_slots,
            tokenizer=info.tokenizer,
        )
        #: what a request made without SamplingParams samples with: the checkpoint's
        #: generation_config.json defaults unless generation_config="ignore"
        self.default_sampling_params = SamplingParams(
            **(info.sampling_defaults if config.generation_config == "auto" else {})
        )
        #: sleep, wake and weight pushes; it keeps the engine's one SleepState
        self._sleep_wake = SleepWakeControl(self.config, self.executor, self.engine)
        #: trainer storages direct IPC pushes mapped, kept across pushes (weight_sync)
        self._mapped_storages: Any = None

    @exclusive
    def shutdown(self) -> None:
        """Release the model and its cache: stop the tensor-parallel rank processes,
        or drop the in-process runner and return its GPU memory (idempotent). Later
        calls raise an error saying the LLM was shut down. Guarded like every other
        call: while another thread's call runs, this raises
        :class:`~kvrunner.errors.ConcurrentUseError` (and a call made while this
        runs does too)."""
        if self._mapped_storages is not None:  # the trainers may free that memory now
            self._mapped_storages.close()
        self.runner = None
        self.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @exclusive
    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        cache_salt: str | Seq[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt whose params have ``n > 1`` gives ``n`` outputs in a row (sample 0
        to ``n - 1``, each with its ``sample_index``), sample ``k`` drawn with
        ``params.for_sample(k)``; the samples share the prompt's KV through the
        prefix cache.

        Without ``sampling_params`` every request samples with
        :attr:`default_sampling_params` (the checkpoint's ``generation_config.json``
        where it sets any; see the ``generation_config`` setting).

        ``cache_salt`` (vLLM's request field; one for every prompt, or a list of one
        per prompt, None for none) scopes a request's prefix-cache hits: requests
        share cached blocks only with requests of the same salt
        (``engine/cache_salt.py``). A prompt may also be vLLM's dict,
        ``{"prompt_token_ids": ids, "cache_salt": "tenant-a"}`` (or ``"prompt"``:
        text), carrying its own salt.

        Every prompt is checked before any is queued, so a bad one raises a
        :class:`~kvrunner.errors.RequestError` (a ``ValueError``) naming it and leaves
        the engine as it was; a ``structured_outputs`` constraint is parsed here for
        that (the compile against the vocabulary runs off this thread, once queued).
        """
        self.executor.check()  # a group that failed earlier says so, naming the rank
        self.sleep_state.require_servable("generate")
        if sampling_params is None:
            sampling_params = self.default_sampling_params
        prompts, params = normalize_requests(prompts, sampling_params)
        salts = per_prompt_salts(cache_salt, len(prompts))
        for i, (prompt, salt) in enumerate(zip(prompts, salts, strict=True)):
            prompts[i], own = unpack_prompt(prompt, i)
            if own is not None:
                if salt is not None:
                    raise RequestError(f"request {i}: cache_salt is given twice (in its "
                                       f"prompt dict and as generate's cache_salt)")
                salts[i] = own
        token_lists = [prompt_token_ids(p, i, self.tokenizer) for i, p in enumerate(prompts)]
        for i, sp in enumerate(params):
            if sp.structured_outputs is not None:
                parse_constraint(sp.structured_outputs, name=f"request {i}: ")
        groups = [
            self.engine.make_group(ids, sp, i, cache_salt=salt)
            for i, (ids, sp, salt) in enumerate(zip(token_lists, params, salts, strict=True))
        ]
        seqs = [seq for group in groups for seq in group]  # prompt-major
        try:
            # A Ctrl-C waits for the request being queued or the step it lands in:
            # raised inside the engine's bookkeeping it could leave a request half
            # queued or half admitted, which no abort undoes (a second one does not wait).
            with SigintAtStepEnd() as sigint:
                # Only once every request passed. Every group's first sample is queued
                # before the others, which wait for its prefill to share the prompt's KV.
                for seq in [g[0] for g in groups] + [s for g in groups for s in g[1:]]:
                    self.engine.add_request(seq)
                sigint.check()
                self._run_to_completion(seqs, sum(s.sampling_params.max_tokens for s in seqs),
                                        use_tqdm, sigint)
        except BaseException as e:
            # Ctrl-C or a failure mid-call: this call's requests are aborted (their
            # blocks and state slots freed) and the step in flight settled, so the
            # next call works, unless the executor cannot settle (a rank died).
            self._abort_after(e)
            raise
        return [self._output(p, s) for p, g in zip(prompts, groups, strict=True) for s in g]

    def _run_to_completion(self, seqs: list[Any], total: int, use_tqdm: bool,
                           sigint: SigintAtStepEnd) -> None:
        with tqdm(total=total, desc="generating", disable=not use_tqdm) as bar:
            done = 0
            while self.engine.has_unfinished():
                self.engine.step()
                sigint.check()
                if use_tqdm:  # per step, so only when someone watches the bar
                    now = sum(s.num_output_tokens for s in seqs)
                    bar.update(now - done)
                    done = now

    def _abort_after(self, error: BaseException) -> None:
        try:
            self.engine.abort_and_settle()
        except Exception:
            if isinstance(error, KeyboardInterrupt):
                raise  # settling found a rank dead: that is the news
            # else the error that ended the call is the one to see; a group that
            # failed says so again at the next call

    # -- sleep, wake and weights (the RL loop's half: kvrunner.rl.sleep) ---------------

    @property
    def sleep_state(self) -> SleepState:
        """What is resident, and which calls that allows (read-only use)."""
        return self._sleep_wake.state

    @exclusive
    def sleep(self, level: int = 1, *, discard_weights: bool = False) -> float:
        """Free the device memory the engine holds; returns seconds.

        Level 1 drops the decode graphs and every backend's cache pools. Level 2 also
        frees the weights: kept in pinned host memory, or discarded
        (``discard_weights=True``) when new ones will be pushed before generating.
        Raises :class:`~kvrunner.plugin_api.BackendError` naming the backend whose
        ``release_cache`` kept its pools' memory (the engine is asleep all the same).
        """
        return self._sleep_wake.sleep(level, discard_weights=discard_weights)

    @exclusive
    def wake_up(self, tags: Iterable[str] | str | None = None) -> float:
        """Bring back ``"weights"`` and/or ``"kv_cache"`` (both when ``None``), in either
        order; returns seconds. The KV pool comes back at exactly its start-up size
        on every rank, or :class:`~kvrunner.errors.WakeError` is raised on every
        rank with nothing allocated (retry once memory is free). The prefix cache is
        empty afterwards; the decode graphs are recaptured, blanked, once every part
        is back and the weights are whole."""
        return self._sleep_wake.wake_up(tags)

    @exclusive
    def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        check_finite: bool = True,
        weight_version: WeightVersion | None = None,
        reset_prefix_cache: bool = True,
    ) -> int:
        """Load ``(name, tensor)`` pairs, or a Mapping of them (a ``state_dict``), with
        Hugging Face names and full (unsharded) tensors of any floating dtype, on the
        CPU or a GPU; a generator is fine, and an update may be spread over several
        calls. Returns how many tensors were loaded.

        Each rank takes its tensor-parallel shard in the model's dtype; fused
        projections are filled part by part. A name that is not a ``str`` or not the
        model's, a name given twice, a wrong shape, a value that is not a
        floating-point tensor (or is on the meta device), or (``check_finite``) NaN or
        inf raises :class:`~kvrunner.errors.WeightUpdateError` naming it.

        A list, tuple or Mapping is a transaction: all of it is checked (finiteness in
        one pass) before its first tensor loads, so a refusal leaves the weights as
        they were. A generator is streamed (it may refill one buffer per pair): each
        pair is checked as it is drawn, after the ones before it loaded; refused after
        some loaded, the weights are ``"partial"`` (``cache_info().weights``), the
        error says so, and generation is refused until every tensor this call did not
        load has been pushed. After a call completes the served version is
        ``weight_version`` (unset: the count of updates so far, 1, 2, ...; see
        :attr:`weight_version`), the prefix cache is reset (``reset_prefix_cache=False``
        keeps it, as SGLang's ``flush_cache: false``: then only
        ``salt_prefix_cache_by_weight_version`` keeps old KV from being reused) and, if
        the engine is awake, the graphs are recaptured.
        """
        return self._sleep_wake.update_weights(weights, check_finite=check_finite,
                                               weight_version=weight_version,
                                               reset_prefix_cache=reset_prefix_cache)

    @exclusive
    def update_weights_from_ipc(
        self,
        address: tuple[str, int] | str,
        *,
        authkey: bytes,
        check_finite: bool = True,
        timeout_s: float = 300.0,
        weight_version: WeightVersion | None = None,
        reset_prefix_cache: bool = True,
    ) -> int:
        """Receive one whole push from a trainer's
        :class:`~kvrunner.weight_sync.BucketSender` listening at ``address`` (in
        another process: CUDA IPC on the same GPU, shared memory on the CPU); returns
        how many tensors were loaded. Names, shapes and the TP shards are as for
        :meth:`update_weights`; the whole push is one update. Each bucket is
        acknowledged only once its copy has completed on the device, and judged
        whole (names, shapes, values) before any of it loads. A push that fails (the
        trainer dies, a bucket is malformed, a tensor is refused) raises
        :class:`~kvrunner.weight_sync.WeightSyncError`; refused after a bucket loaded,
        it leaves the weights ``"partial"``: generation is refused until a full push.
        A :class:`~kvrunner.weight_sync.DirectSender`'s push reads the trainer's own
        storages instead of buckets; they stay mapped until that sender closes or a
        push no longer names them, or :meth:`shutdown`. ``weight_version`` and
        ``reset_prefix_cache`` as for :meth:`update_weights`. See docs/weight_sync.md."""
        from kvrunner.weight_sync.mapped_storages import MappedStorages
        from kvrunner.weight_sync.receiver import receive_push

        if self._mapped_storages is None:
            self._mapped_storages = MappedStorages()
        session = functools.partial(self._sleep_wake.push_session,
                                    weight_version=weight_version,
                                    reset_prefix_cache=reset_prefix_cache)
        return receive_push(session, address, authkey,
                            check_finite_values=check_finite, timeout_s=timeout_s,
                            storages=self._mapped_storages)

    @exclusive
    def update_weights_from_tensor(
        self, serialized_named_tensors: list[str | bytes], load_format: str | None = None,
        *, check_finite: bool = True, weight_version: WeightVersion | None = None,
        reset_prefix_cache: bool = True,
    ) -> int:
        """Load SGLang's ``serialized_named_tensors`` (its ``update_weights_from_tensor``
        body, :mod:`kvrunner.weight_sync.tensor_payload`): one
        ``MultiprocessingSerializer`` payload per tensor-parallel rank, entry ``r``
        opened by rank ``r`` in its own process (its CUDA IPC handles name that rank's
        GPU), ``load_format`` None / ``"direct"`` (``(name, tensor)`` pairs) or
        ``"flattened_bucket"``. A transaction: a count of entries other than
        ``tensor_parallel_size``, entries holding different tensors, a payload the
        restricted unpickler refuses, or a value, name or shape
        :meth:`update_weights` would refuse raises
        :class:`~kvrunner.weight_sync.WeightSyncError` before any rank loads.
        Returns once every copy out of the trainer's memory is done on the device;
        ``check_finite``, ``weight_version`` and ``reset_prefix_cache`` as for
        :meth:`update_weights`. Returns how many tensors loaded."""
        return self._sleep_wake.update_weights_from_tensor(
            serialized_named_tensors, load_format, check_finite=check_finite,
            weight_version=weight_version, reset_prefix_cache=reset_prefix_cache)

    @exclusive
    def update_weights_from_ipc_handles(
        self, names: Seq[str], dtype_names: Seq[str],
        shapes: Seq[Seq[int]], ipc_handles: Any = None, *,
        ipc_handles_pickled: str | bytes | None = None,
        tensor_sizes: Seq[int] | None = None, packed: bool | None = None,
        element_sizes: Seq[int] | None = None,
        check_finite: bool = True, weight_version: WeightVersion | None = None,
        reset_prefix_cache: bool = True,
    ) -> int:
        """Load tensors a colocated trainer shares by CUDA IPC, as vLLM's IPC weight
        transfer sends them (:mod:`kvrunner.weight_sync.ipc_handles`): the announced
        ``names``, ``dtype_names`` and ``shapes``, and either ``ipc_handles`` (what
        ``reduce_tensor`` made, keyed by GPU UUID: a list, one per tensor, or one dict
        for a packed ``uint8`` buffer with ``tensor_sizes``, or, as SkyRL packs it, for
        a buffer of the tensors' one dtype with ``element_sizes``) or the same pickled and
        base64-encoded (``ipc_handles_pickled``, read by a reader that resolves torch's
        CUDA rebuild and nothing else). Each rank opens the handles of its own GPU
        (one for another GPU is refused naming both UUIDs) and takes its shard. A
        transaction: the payload, the announced names and shapes, each handle's
        tensor against them, and the values are judged on every rank before any
        loads, so a refusal (:class:`~kvrunner.weight_sync.WeightSyncError`) leaves
        the old weights serving. Inside an update opened by
        :meth:`start_weight_update` the call is one part of it (a refused part closes
        it, ``"partial"`` if an earlier part loaded); otherwise it is one update by
        itself, and ``check_finite``, ``weight_version`` and ``reset_prefix_cache`` are
        as for :meth:`update_weights`. Returns once every copy out of the trainer's
        memory is done on the device; returns how many tensors loaded."""
        from kvrunner.weight_sync.ipc_handles import IpcUpdate

        update = IpcUpdate.of(names, dtype_names, shapes, ipc_handles=ipc_handles,
                              ipc_handles_pickled=ipc_handles_pickled,
                              tensor_sizes=tensor_sizes, packed=packed,
                              element_sizes=element_sizes)
        return self._sleep_wake.update_weights_from_ipc_handles(
            update, check_finite=check_finite, weight_version=weight_version,
            reset_prefix_cache=reset_prefix_cache)

    @exclusive
    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        *, backend: str = "nccl", group_name: str = "kvrunner_weights",
        timeout_s: float = 300.0,
    ) -> None:
        """Join every engine rank to a weight-update process group with the trainer's
        rank 0 (its own store, never the TP group): engine rank ``r`` is group rank
        ``rank_offset + r``. The trainer joins at the same time
        (:class:`~kvrunner.weight_sync.broadcaster.WeightBroadcaster`)."""
        self.executor.check()
        self._sleep_wake.ranks.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, backend, group_name,
            timeout_s)

    @exclusive
    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
        packed_bytes: int | None = None,
        weight_version: WeightVersion | None = None, reset_prefix_cache: bool = True,
    ) -> int:
        """Receive the announced tensors from the group's rank 0 (full tensors; each
        rank keeps its shard): one broadcast per tensor, or with ``packed_bytes`` vLLM's
        packed chunks of about that many bytes
        (:mod:`kvrunner.weight_sync.packed_broadcast`). The announced names, dtypes and
        shapes are judged before the first broadcast is received (a refusal loads
        nothing); a failure part way leaves the weights ``"partial"``, as
        :meth:`update_weights_from_ipc`. Inside an update opened by
        :meth:`start_weight_update` the call is one part of it; otherwise it is one
        weight update by itself, and ``weight_version`` and ``reset_prefix_cache`` are as
        for :meth:`update_weights`. Returns how many tensors loaded."""
        ranks = self._sleep_wake.ranks
        return self._sleep_wake.in_update(
            "update_weights_from_distributed",
            lambda: ranks.update_weights_from_distributed(
                list(names), list(dtypes), [list(s) for s in shapes], packed_bytes)[0],
            weight_version=weight_version, reset_prefix_cache=reset_prefix_cache)

    @exclusive
    def start_weight_update(self) -> None:
        """Open one weight update that spans calls (vLLM's ``start_weight_update``):
        each :meth:`update_weights_from_distributed` until :meth:`finish_weight_update`
        is a part of it, and the whole is one push (one prefix-cache reset and
        recapture, at the end; a part that fails closes it as a failed push). While
        it is open, generation, sleep and every other weight change are refused.
        Refused while requests run unpaused, as :meth:`update_weights`."""
        self._sleep_wake.start_update()

    @exclusive
    def finish_weight_update(self, *, weight_version: WeightVersion | None = None) -> None:
        """Close the update :meth:`start_weight_update` opened: generation resumes on
        the new weights, served as ``weight_version`` (unset: the count of updates).
        Refused (``SleepStateError``) when none is open."""
        self._sleep_wake.finish_update(weight_version)

    @property
    def weight_update_open(self) -> bool:
        """Whether :meth:`start_weight_update` opened an update not finished yet."""
        return self._sleep_wake.state.update_open

    @exclusive
    def destroy_weights_update_group(self) -> None:
        """Leave the weight-update group (idempotent)."""
        self._sleep_wake.ranks.destroy_weights_update_group()

    @exclusive
    def weights_checksum(self) -> dict[str, str]:
        """Per-tensor digests (16 hex digits) of the engine's weights under their
        Hugging Face names, tensor-parallel shards merged: equal to
        ``kvrunner.weight_sync.checksum.tensor_digests(tensors, llm.runner dtype)`` on
        the full tensors, so a trainer can check that a push landed. Every name
        loaded since start-up is listed."""
        from kvrunner.weight_sync.checksum import merge_digests

        self.executor.check()
        self.sleep_state.require_weights_resident("weights_checksum")
        return merge_digests(self._sleep_wake.ranks.weight_digests())

    @exclusive
    def load_weights(
        self, path: str | Path, *, check_finite: bool = True,
        weight_version: WeightVersion | None = None, reset_prefix_cache: bool = True,
    ) -> int:
        """Load every tensor of a safetensors checkpoint directory (each rank reads it),
        as :meth:`update_weights` does; returns how many were loaded. The directory
        must hold the whole model: a wrong shape, a missing, unexpected, duplicated or
        integer tensor (read from the safetensors headers), or (``check_finite``)
        NaN or inf raises :class:`~kvrunner.errors.CheckpointError` naming the file
        and the tensor. It is a transaction: everything is checked before the first
        tensor loads (the values in a pass of their own), so a refused checkpoint
        leaves the weights as they were. ``weight_version`` and ``reset_prefix_cache``
        as for :meth:`update_weights`."""
        return self._sleep_wake.load_weights(path, check_finite=check_finite,
                                             weight_version=weight_version,
                                             reset_prefix_cache=reset_prefix_cache)

    @property
    def weight_version(self) -> WeightVersion:
        """The version of the weights served: 0 from start-up, then what the last
        completed update named (unnamed: the count of updates, 1, 2, ...). Every
        output carries the version it was made under."""
        return self.engine.weight_version

    @exclusive
    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many blocks were uncached."""
        return self._sleep_wake.reset_prefix_cache()

    @exclusive
    def recapture(self) -> float:
        """Capture every decode graph again (blanked, as at start-up); returns seconds."""
        return self._sleep_wake.recapture()

    @exclusive
    def cache_info(self) -> CacheInfo:
        """A frozen record of the pool, what is resident, and the last sleep / wake."""
        return self._sleep_wake.cache_info()

    def _output(self, prompt: Prompt, seq: Any) -> RequestOutput:
        out = list(seq.output_token_ids)
        wants = seq.sampling_params.logprobs is not None
        scored = seq.sampling_params.prompt_logprobs
        return RequestOutput(
            request_id=seq.seq_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=list(seq.token_ids[: seq.num_prompt_tokens]),
            token_ids=out,
            text=self._text(seq, out),
            logprobs=list(seq.logprobs) if wants else None,
            top_logprobs=list(seq.top_logprobs) if wants and seq.sampling_params.logprobs else None,
            finish_reason=seq.finish_reason,
            prompt_logprobs=None if scored is None else [None, *seq.prompt_logprobs],
            prompt_top_logprobs=[None, *seq.prompt_top_logprobs] if scored else None,
            prompt_ranks=None if scored is None else [None, *seq.prompt_ranks],
            error=seq.error,
            sample_index=seq.sample_index,
            stop_reason=seq.stop_reason,
            kept_mass=list(seq.kept_mass) if seq.sampling_params.return_kept_mass else None,
            routed_experts=seq.routed_experts() if seq.sampling_params.return_routed_experts
            else None,
            weight_version=self.engine.weight_version,
            weight_versions=((self.engine.weight_version, 0),),
            num_cached_tokens=max(seq.num_cached_tokens, 0),
        )

    def _text(self, seq: Any, out: list[int]) -> str:
        """The output text: up to the stop string that ended it, if one did."""
        if seq.stop_string is not None:
            return seq.stop_watch.output_text
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(
            out, skip_special_tokens=seq.sampling_params.skip_special_tokens)
