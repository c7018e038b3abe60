"""The calls a driver makes on every rank between steps, and how refusals come back.

:class:`RankCalls` is what every rank answers to ``("call", name, args)`` (and what
the in-process executor calls directly; the driver makes them through
:class:`~kvrunner.runner.ranks.rank_client.RankClient`): capture, describe, sleep, wake, weight
updates, cache info. A call that fails in a way that leaves the rank consistent (a
wake refused for memory, a bad weight name) is *answered* with a :class:`Refused`
instead of killing the rank, so the driver raises the same error and the group
keeps serving.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs
import torch

from kvrunner.errors import CheckpointError, SleepStateError, WakeError, WeightUpdateError
from kvrunner.layers.fused.dispatch import chosen_kernels
from kvrunner.models.weight_specs import TensorSpec
from kvrunner.runner.ranks.rank_reports import PushReport, RankCacheInfo, SleepReport, WakeReport

#: errors after which a rank is still consistent and serving
RECOVERABLE = (WakeError, WeightUpdateError, SleepStateError, CheckpointError)

#: how many bytes of weights one message to the ranks carries
WEIGHT_BUCKET_BYTES = 512 << 20


@attrs.frozen
class Refused:
    """A rank's answer when a call raised one of :data:`RECOVERABLE`."""

    error: BaseException


def raise_refused(answers: Sequence[Any]) -> list[Any]:
    """``answers`` unchanged, or the lowest rank's refusal raised in the driver, with
    ``refused_by`` set to every refusing rank (a wake refused by the preflight is
    refused, with the same message, by all of them)."""
    refused = [r for r, answer in enumerate(answers) if isinstance(answer, Refused)]
    if refused:
        error = answers[refused[0]].error
        error.refused_by = refused
        raise error
    return list(answers)


def runner_summary(runner: Any, rank: int) -> dict[str, Any]:
    """What a rank holds: its pool sizes (own and agreed), graphs, device, process, and
    the kernel choices its layers follow."""
    return {
        "rank": rank,
        "pid": os.getpid(),
        "device": str(runner.device),
        "own_num_blocks": runner.pool_size.own_num_blocks,
        "num_blocks": runner.pool_size.num_blocks,
        "max_num_batched_tokens": runner.max_num_batched_tokens,
        "max_model_len": runner.model_len.value,
        "max_model_len_source": runner.model_len.source,
        "max_model_len_reason": runner.model_len.reason,
        "graph_sizes": sorted(runner.graph_capture.graphs),
        "capture_seconds": runner.graph_capture.capture_seconds,
        "nan_rows": runner.launcher.nan_rows,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "all_reduce": runner.group.all_reduce_impl if runner.group is not None else "none",
        "all_reduce_reason": runner.group.all_reduce_reason if runner.group is not None else "",
        "kernels": attrs.asdict(chosen_kernels()),
        "graph_end": runner.graph_capture.graph_end,
    }


def weight_buckets(
    weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = WEIGHT_BUCKET_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Host copies of ``weights`` in lists of about ``bucket_bytes`` (to send to ranks);
    a generator is consumed lazily, one bucket at a time."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        host = tensor.detach().to("cpu").contiguous()
        bucket.append((name, host))
        size += host.numel() * host.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


class RankCalls:
    """The between-steps calls of one rank, on its runner (a ModelRunner).

    :param describe_extra: what :meth:`describe` adds to :func:`runner_summary`
        (a worker adds the last tokens it sampled).
    """

    def __init__(
        self, runner: Any, rank: int, *,
        describe_extra: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.runner = runner
        self.rank = rank
        self._describe_extra = describe_extra
        #: this rank's weight-update group (kvrunner.weight_sync), once joined
        self.update_group: Any = None
        #: the pairs of SGLang's payload or vLLM's IPC handles this rank opened and
        #: judged, until loaded or dropped (they map the trainer's memory)
        self._staged: list[tuple[str, torch.Tensor]] | None = None
        from kvrunner.weight_sync.ipc_mappings import IpcMappings

        #: the trainer storages vLLM's IPC handles opened, held while the update's calls
        #: name them (a share sent with several chunks is then released once)
        self._ipc = IpcMappings()

    def capture(self) -> float:
        return self.runner.capture()

    def describe(self) -> dict[str, Any]:
        return {**runner_summary(self.runner, self.rank), **self._describe_extra()}

    def sleep(self, level: int, discard_weights: bool) -> SleepReport:
        return self.runner.sleep_wake.sleep(level, discard_weights)

    def wake_up(self, tags: tuple[str, ...]) -> WakeReport:
        return self.runner.sleep_wake.wake_up(tags)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        return self.runner.weights.update(weights)

    def check_weights(self, specs: list[TensorSpec]) -> None:
        """Judge a pushed update's names and shapes whole, loading nothing."""
        self.runner.weights.check(specs)

    def load_weights(self, path: str, check_finite: bool = True) -> int:
        return self.runner.weights.load(path, check_finite)

    def begin_weight_update(self) -> None:
        self.runner.weights.begin_update()

    def fail_weight_update(self) -> PushReport:
        self._ipc.release()
        return self.runner.weights.fail_update()

    def finish_weight_update(self) -> PushReport:
        self._ipc.release()  # every copy out of the trainer's memory is done
        return self.runner.weights.finish_update(self.runner.sleep_wake.recapture_if_whole)

    def cache_info(self) -> RankCacheInfo:
        return self.runner.sleep_wake.cache_info(self.rank)

    def init_weights_update_group(self, master_address: str, master_port: int,
                                  rank_offset: int, world_size: int, backend: str,
                                  group_name: str, timeout_s: float) -> None:
        """Join a weight-update group as ``rank_offset + rank`` (kvrunner.weight_sync)."""
        from kvrunner.weight_sync.update_group import UpdateGroup, make_group

        self.destroy_weights_update_group()  # a new group replaces the old one
        group = make_group(master_address=master_address, master_port=master_port,
                           rank=rank_offset + self.rank, world_size=world_size,
                           backend=backend, group_name=group_name, timeout_s=timeout_s,
                           is_master=False, device=self.runner.device)
        self.update_group = UpdateGroup(group, self.runner.device, backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]],
                                        packed_bytes: int | None = None) -> int:
        """Receive the announced tensors from the group's rank 0 (one broadcast each,
        or vLLM's packed chunks) and load them."""
        group = self.update_group
        if group is None:
            raise SleepStateError("no weight-update group: call init_weights_update_group")
        weights = self.runner.weights
        return group.receive(names, dtypes, shapes, weights.update, check=weights.check,
                             packed_bytes=packed_bytes)

    def stage_tensor_payload(self, serialized: list[str | bytes], load_format: str | None,
                             check_finite: bool) -> list[TensorSpec]:
        """Open this rank's entry of SGLang's ``serialized_named_tensors`` (entry
        ``rank``, in this process: its CUDA IPC handles name this rank's GPU), judge
        its values, names and shapes whole, and hold the pairs for
        :meth:`load_staged_payload`; returns their specs (the driver checks that the
        ranks agree). Loads nothing."""
        from kvrunner.weight_sync.tensor_payload import rank_tensors

        self._staged = None
        pairs = rank_tensors(serialized, load_format, self.rank, check_finite=check_finite)
        specs = [TensorSpec.of(name, tensor) for name, tensor in pairs]
        self.runner.weights.check(specs)
        self._staged = pairs
        return specs

    def stage_ipc_handles(self, update: Any, check_finite: bool) -> None:
        """Judge vLLM's IPC update (a :class:`~kvrunner.weight_sync.ipc_handles.
        IpcUpdate`): its announced names and shapes against the model, then its
        handles, opened in this process from the entries of this rank's own GPU, their
        values checked; hold the pairs for :meth:`load_staged_payload`. Loads
        nothing."""
        from kvrunner.weight_sync.ipc_handles import open_handles

        self._staged = None
        self.runner.weights.check(update.specs())
        self._staged = open_handles(update, self.runner.device, check_finite=check_finite,
                                    mappings=self._ipc)

    def load_staged_payload(self) -> int:
        """Load the pairs :meth:`stage_tensor_payload` or :meth:`stage_ipc_handles`
        held and let them go once the copies are done on the device (the trainer may
        then reuse its memory)."""
        pairs, self._staged = self._staged, None
        if pairs is None:
            raise SleepStateError("no staged tensor payload to load: "
                                  "stage_tensor_payload opens one")
        loaded = self.runner.weights.update(pairs)
        if self.runner.device.type == "cuda":
            torch.cuda.current_stream(self.runner.device).synchronize()
        return loaded

    def drop_staged_payload(self) -> None:
        """Let go of a staged payload without loading it (another rank refused its
        own)."""
        self._staged = None

    def destroy_weights_update_group(self) -> None:
        """Leave the weight-update group, if this rank is in one."""
        group, self.update_group = self.update_group, None
        if group is not None:
            group.destroy()

    def weight_digests(self) -> dict[str, tuple[int, int, int]]:
        """This rank's part of ``weights_checksum`` (kvrunner.weight_sync.checksum)."""
        from kvrunner.weight_sync.checksum import rank_digests

        return rank_digests(self.runner.model)


#: the calls a ("call", name, args) command may run
CALLS = frozenset(
    name for name, value in vars(RankCalls).items() if callable(value) and not name.startswith("_")
)


def call_name(method: Callable[..., Any]) -> str:
    """The wire name of a :class:`RankCalls` method (refusing anything else)."""
    name = getattr(method, "__name__", "")
    if name not in CALLS or getattr(RankCalls, name) is not method:
        raise ValueError(f"{method!r} is not one of the rank calls {sorted(CALLS)}")
    return name
