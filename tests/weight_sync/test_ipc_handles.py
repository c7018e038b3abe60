"""vLLM's IPC weight transfer, everything but opening a handle (which needs a GPU:
test_ipc_handles_gpu.py): the pickled handles are read by a reader that resolves
torch's CUDA rebuild and the classes its arguments name and nothing else, and
calls none of them; every handle is checked against the announcement before any is
opened; a handle for another GPU is refused naming both UUIDs. On an engine, each
refusal comes before any rank loads: the old weights serve on, not ``partial``."""

from __future__ import annotations

import base64
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from push_kit import tokens
from trainer_process import checkpoint_tensors
from vllm_ipc_payloads import (
    OTHER_GPU,
    TRAINER_GPU,
    b64,
    cuda_args,
    packed,
    per_tensor,
    skyrl_packed,
)

from kvrunner.errors import WeightUpdateError
from kvrunner.weight_sync import WeightSyncError
from kvrunner.weight_sync.ipc_handles import IpcUpdate, own_handle, read_handles
from kvrunner.weight_sync.tensor_unpickler import CUDA_IPC_REBUILD

SPECS = [("a", "bfloat16", [4, 8]), ("b", "float32", [8]), ("c", "float16", [3, 5])]


def update(info: dict[str, Any]) -> IpcUpdate:
    return IpcUpdate.of(info["names"], info["dtype_names"], info["shapes"],
                        ipc_handles_pickled=info["ipc_handles_pickled"],
                        tensor_sizes=info.get("tensor_sizes"), packed=info.get("packed"),
                        element_sizes=info.get("sizes"))


def with_handles(handles: Any, specs: list[tuple[str, str, list[int]]] = SPECS,
                 **extra: Any) -> dict[str, Any]:
    return {**per_tensor(specs), "ipc_handles_pickled": b64(handles), **extra}


@pytest.mark.parametrize("with_function", [True, False])
def test_one_handle_per_tensor_is_read_in_either_of_vllms_forms(with_function) -> None:
    read = read_handles(update(per_tensor(SPECS, with_function=with_function)))
    assert not read.packed and len(read.entries) == len(SPECS)
    for (_, dtype, shape), by_gpu in zip(SPECS, read.entries, strict=True):
        args = by_gpu[TRAINER_GPU]
        # the class tokens are resolved to torch's classes, for torch's rebuild
        assert args[0] is torch.Tensor and args[4] is torch.storage.TypedStorage
        assert tuple(args[1]) == tuple(shape) and args[5] == getattr(torch, dtype)


def test_a_packed_buffer_is_read_with_its_sizes() -> None:
    read = read_handles(update(packed(SPECS, buffer_bytes=1 << 12)))
    assert read.packed and list(read.entries[0]) == [TRAINER_GPU]
    assert read.entries[0][TRAINER_GPU][5] == torch.uint8


class RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class Calls:
    """A pickle that calls ``func(*args)`` while it is read."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize(("payload", "named"), [
    (lambda m: [{TRAINER_GPU: RunsACommand(m)}], r"posix\.system"),
    (lambda m: [{TRAINER_GPU: (os.system, ("x",))}], r"posix\.system"),
    (lambda m: [{TRAINER_GPU: (eval, ("1",))}], r"builtins\.eval"),
    # torch's other rebuilds are not read either: only the CUDA one
    (lambda m: [{TRAINER_GPU: (torch.multiprocessing.reductions.rebuild_storage_filename,
                               ("x",))}], "rebuild_storage_filename"),
    (lambda m: [{TRAINER_GPU: (torch._utils._rebuild_tensor_v2, ("x",))}],
     "_rebuild_tensor_v2"),
    (lambda m: [{TRAINER_GPU: torch.ones(2)}], r"torch\._utils\._rebuild_tensor_v2"),
    # the handle is opened by the engine for its own GPU, never while the pickle is read
    (lambda m: [{TRAINER_GPU: Calls(torch.multiprocessing.reductions.rebuild_cuda_tensor,
                                    *cuda_args([4, 8], torch.bfloat16))}],
     "calls torch.multiprocessing.reductions.rebuild_cuda_tensor while it is read"),
    (lambda m: [{TRAINER_GPU: Calls(torch.UntypedStorage, 1 << 40)}],
     r"calls torch\.storage\.UntypedStorage while it is read"),
])
def test_a_pickle_naming_any_other_callable_is_refused_by_name_and_nothing_runs(
    payload, named, tmp_path
) -> None:
    marker = tmp_path / "ran"
    body = with_handles(payload(marker), SPECS[:1])
    with pytest.raises(WeightSyncError, match=rf"ipc_handles_pickled.*{named}"):
        read_handles(update(body))
    assert not marker.exists()


def args_with(index: int, value: Any) -> tuple[Any, ...]:
    args = list(cuda_args([4, 8], torch.bfloat16))
    args[index] = value
    return tuple(args)


@pytest.mark.parametrize(("handle", "message"), [
    (cuda_args([4, 8], torch.bfloat16)[:14], "15 rebuild_cuda_tensor arguments.*got 14"),
    ((torch.Size, cuda_args([4, 8], torch.bfloat16)), "function is <class 'torch.Size'>"),
    (args_with(4, torch.Tensor), "storage class is <class 'torch.Tensor'>"),
    (args_with(0, torch.Size), "tensor class is <class 'torch.Size'>"),
    (args_with(6, True), "device is bool"),
    (args_with(7, "handle"), "storage handle is str"),
    (args_with(8, 63), r"runs past its storage of 63 bytes"),
    (args_with(3, 1), r"offset 1\) runs past its storage"),
    (args_with(2, (8,)), "differ in length"),
    ("not a handle", "got str"),
])
def test_a_malformed_handle_is_refused_naming_the_tensor_and_the_argument(
    handle, message
) -> None:
    body = with_handles([{TRAINER_GPU: handle}], SPECS[:1])
    with pytest.raises(WeightSyncError, match=rf"ipc_handles\[0\] \('a'\) for GPU "
                                              rf"{TRAINER_GPU}: .*{message}"):
        read_handles(update(body))


@pytest.mark.parametrize(("dtype", "shape", "says"), [
    (torch.float32, [4, 8], r"holds a float32 \[4, 8\] tensor, but update_info announces "
                            r"bfloat16 \[4, 8\]"),
    (torch.bfloat16, [8, 4], r"holds a bfloat16 \[8, 4\] tensor, but update_info announces "
                             r"bfloat16 \[4, 8\]"),
])
def test_a_handle_other_than_announced_is_refused(dtype, shape, says) -> None:
    body = with_handles([{TRAINER_GPU: cuda_args(shape, dtype)}], SPECS[:1])
    with pytest.raises(WeightSyncError, match=says):
        read_handles(update(body))


@pytest.mark.parametrize(("change", "message"), [
    (lambda b: b.pop("tensor_sizes"), "needs update_info.tensor_sizes"),
    (lambda b: b["tensor_sizes"].__setitem__(1, 31), r"tensor_sizes\[1\] \('b'\) is 31 bytes, "
                                                     r"but float32 \[8\] is 32"),
    (lambda b: b.update(ipc_handles_pickled=b64({TRAINER_GPU: cuda_args([64], torch.uint8)})),
     "tensor_sizes add up to 126 bytes, but the buffer holds 64"),
    (lambda b: b.update(ipc_handles_pickled=b64({TRAINER_GPU: cuda_args([63],
                                                                         torch.bfloat16)})),
     r"a packed buffer is a flat uint8 tensor, the handle holds bfloat16 \[63\]"),
    (lambda b: b.update(packed=False), "packed is false, but ipc_handles holds one handle dict"),
])
def test_a_packed_update_is_checked_against_its_sizes(change, message) -> None:
    body = packed(SPECS)
    change(body)
    with pytest.raises(WeightSyncError, match=message):
        read_handles(update(body))


SKYRL_SPECS = [("a", "bfloat16", [4, 8]), ("b", "bfloat16", [8]), ("c", "bfloat16", [3, 5])]


def test_skyrls_chunk_packed_by_elements_is_read_as_byte_sizes() -> None:
    read = read_handles(update(skyrl_packed(SKYRL_SPECS)))
    assert read.packed and read.entries[0][TRAINER_GPU][5] == torch.bfloat16
    assert read.byte_sizes == (64, 16, 30)


@pytest.mark.parametrize(("change", "message"), [
    (lambda b: b["sizes"].__setitem__(1, 9), r"sizes\[1\] \('b'\) is 9 elements, but "
                                             r"bfloat16 \[8\] is 8"),
    (lambda b: b.update(ipc_handles_pickled=b64({TRAINER_GPU: cuda_args([50],
                                                                        torch.bfloat16)})),
     "sizes add up to 55 elements, but the buffer holds 50"),
    (lambda b: b.update(ipc_handles_pickled=b64({TRAINER_GPU: cuda_args([55],
                                                                        torch.float32)})),
     r"a buffer packed by elements \(sizes\) is a flat bfloat16 tensor, as dtype_names "
     r"announce; the handle holds float32 \[55\]"),
    (lambda b: b["dtype_names"].__setitem__(2, "float32"),
     r"sizes counts elements of one dtype, but dtype_names holds \['bfloat16', 'float32'\]"),
    (lambda b: b.update(tensor_sizes=[64, 16, 30]), "both tensor_sizes .* and sizes"),
    (lambda b: b["sizes"].pop(), "update_info.sizes has 2 entries for 3 names"),
])
def test_skyrls_chunk_is_checked_against_its_element_sizes(change, message) -> None:
    body = skyrl_packed(SKYRL_SPECS)
    change(body)
    with pytest.raises(WeightSyncError, match=message):
        read_handles(update(body))


def test_the_form_and_the_counts_are_checked() -> None:
    with pytest.raises(WeightSyncError, match="ipc_handles has 2 entries for 3 names"):
        read_handles(update(with_handles(pickle.loads(base64.b64decode(
            per_tensor(SPECS)["ipc_handles_pickled"]))[:2])))
    with pytest.raises(WeightSyncError, match="packed is true, but ipc_handles holds a list"):
        read_handles(update({**per_tensor(SPECS), "packed": True}))
    with pytest.raises(WeightSyncError, match="holds a str"):
        read_handles(update(with_handles("handles")))
    with pytest.raises(WeightSyncError, match=r"ipc_handles\[0\] \('a'\) is dict \{\}"):
        read_handles(update(with_handles([{}, {}, {}])))
    with pytest.raises(WeightSyncError, match="not base64"):
        read_handles(update({**per_tensor(SPECS), "ipc_handles_pickled": "not base64!"}))
    with pytest.raises(WeightSyncError, match="dtype 'int8' is not one of"):
        read_handles(update(per_tensor([("a", "int8", [4])])))
    with pytest.raises(WeightSyncError, match="exactly one of ipc_handles and "
                                              "ipc_handles_pickled"):
        IpcUpdate.of(["a"], ["float32"], [[1]], ipc_handles=[], ipc_handles_pickled="")
    with pytest.raises(WeightSyncError, match="needs ipc_handles_pickled"):
        IpcUpdate.of(["a"], ["float32"], [[1]])
    with pytest.raises(WeightSyncError, match="shapes has 2 entries for 1 names"):
        IpcUpdate.of(["a"], ["float32"], [[1], [2]], ipc_handles=[])


def test_a_handle_for_another_gpu_is_refused_naming_both_uuids() -> None:
    read = read_handles(update(per_tensor(SPECS)))
    args = own_handle(read.entries[0], TRAINER_GPU, "cuda:0", "ipc_handles[0] ('a')")
    assert args is read.entries[0][TRAINER_GPU]
    with pytest.raises(WeightSyncError, match=rf"no handle for this engine rank's GPU "
                                              rf"{OTHER_GPU} \(cuda:0\); the handle is for "
                                              rf"GPU {TRAINER_GPU}"):
        own_handle(read.entries[0], OTHER_GPU, "cuda:0", "ipc_handles[0] ('a')")
    with pytest.raises(WeightSyncError, match=rf"runs on cpu, which has no GPU UUID.*"
                                              rf"{TRAINER_GPU}"):
        own_handle(read.entries[0], None, "cpu", "ipc_handles[0] ('a')")


def test_the_raw_handles_of_vllms_ray_client_are_read_as_the_pickled_ones() -> None:
    handles = [{TRAINER_GPU: (torch.multiprocessing.reductions.rebuild_cuda_tensor,
                              cuda_args(shape, getattr(torch, dtype)))}
               for _, dtype, shape in SPECS]
    raw = IpcUpdate.of(*zip(*SPECS, strict=True), ipc_handles=handles)
    read = read_handles(raw)
    assert [list(e) for e in read.entries] == [[TRAINER_GPU]] * 3
    assert CUDA_IPC_REBUILD.target is torch.multiprocessing.reductions.rebuild_cuda_tensor


def model_specs(checkpoints) -> list[tuple[str, str, list[int]]]:
    return [(name, "float32", list(t.shape))
            for name, t in checkpoint_tensors(str(checkpoints.path(2)), 0)]


@pytest.mark.parametrize("fault", ["unknown_name", "wrong_shape", "no_gpu", "hostile"])
def test_a_refused_update_leaves_the_old_weights_serving(llm, checkpoints, fault,
                                                         tmp_path) -> None:
    before, version = tokens(llm), llm.weight_version
    specs = model_specs(checkpoints)
    if fault == "unknown_name":
        specs[3] = ("model.not_a_layer.weight", *specs[3][1:])
        body, says = per_tensor(specs), "not_a_layer"
    elif fault == "wrong_shape":
        specs[3] = (specs[3][0], "float32", [*specs[3][2][:-1], specs[3][2][-1] + 1])
        body, says = per_tensor(specs), specs[3][0]
    elif fault == "no_gpu":  # a well-formed update: this CPU engine's rank has no GPU
        body, says = per_tensor(specs), rf"runs on cpu.*GPU {TRAINER_GPU}"
    else:
        body = {**per_tensor(specs), "ipc_handles_pickled": b64(
            [{TRAINER_GPU: RunsACommand(tmp_path / "ran")}] * len(specs))}
        says = r"posix\.system"
    with pytest.raises(WeightUpdateError, match=says):  # the model's refusal, or the sync's
        llm.update_weights_from_ipc_handles(body["names"], body["dtype_names"],
                                            body["shapes"],
                                            ipc_handles_pickled=body["ipc_handles_pickled"])
    assert not (tmp_path / "ran").exists()
    assert llm.cache_info().weights == "resident"
    assert llm.weight_version == version
    assert tokens(llm) == before


def test_a_part_refused_inside_an_open_update_closes_it_and_the_old_weights_serve(
    llm, checkpoints
) -> None:
    before = tokens(llm)
    body = per_tensor(model_specs(checkpoints))
    llm.start_weight_update()
    with pytest.raises(WeightSyncError, match="runs on cpu"):
        llm.update_weights_from_ipc_handles(body["names"], body["dtype_names"],
                                            body["shapes"],
                                            ipc_handles_pickled=body["ipc_handles_pickled"])
    assert not llm.weight_update_open
    assert llm.cache_info().weights == "resident"
    assert tokens(llm) == before
