"""SGLang's ``serialized_named_tensors`` are read by a pickle reader that rebuilds
tensors and nothing else: a pickle that would run code is refused by the name of what
it calls, before anything runs; tensors come back equal whichever way torch pickled
them; a flattened bucket's entries are checked against its flat tensor."""

from __future__ import annotations

import base64
import io
import os
import pickle
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

from kvrunner.weight_sync import WeightSyncError
from kvrunner.weight_sync.tensor_payload import bucket_tensors, named_tensors
from kvrunner.weight_sync.tensor_unpickler import unpickle_tensors

sys.path.insert(0, str(Path(__file__).parent))
from peer_trainers import flattened_bucket, serialize, sglang_metadata_class  # noqa: E402


class RunsACommand:
    """What an attacker posts: unpickling it calls os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class CallsEval:
    def __reduce__(self):
        return eval, ("__import__('os').getpid()",)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize("make", [
    lambda marker: pickle.dumps(RunsACommand(marker)),
    lambda marker: pickle.dumps([("w", torch.ones(2)), ("x", RunsACommand(marker))]),
    lambda marker: pickle.dumps({"flattened_tensor": RunsACommand(marker), "metadata": []}),
])
def test_a_pickle_that_would_run_a_command_is_refused_and_nothing_runs(make, tmp_path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(WeightSyncError, match=r"calls posix\.system.*refused"):
        unpickle_tensors(b64(make(marker)), what="entry")
    assert not marker.exists()


def test_eval_and_a_persistent_id_are_refused_by_name() -> None:
    with pytest.raises(WeightSyncError, match=r"calls builtins\.eval"):
        unpickle_tensors(pickle.dumps(CallsEval()), what="entry")
    buf = io.BytesIO()
    torch.save(torch.ones(2), buf)  # torch.save's inner pickle: persistent ids
    with pytest.raises(WeightSyncError, match="entry"):
        unpickle_tensors(buf.getvalue(), what="entry")


class StorageFromBytes:
    """A plain pickle's storage: torch.storage._load_from_bytes on torch.save bytes."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self):
        return torch.storage._load_from_bytes, (self.data,)


def test_a_plain_pickled_storage_is_loaded_as_weights_only(tmp_path) -> None:
    marker = tmp_path / "ran"
    evil = io.BytesIO()
    torch.save(RunsACommand(marker), evil)  # torch's own _load_from_bytes would run it
    with pytest.raises(WeightSyncError, match="entry"):
        unpickle_tensors(pickle.dumps(StorageFromBytes(evil.getvalue())), what="entry")
    assert not marker.exists()
    good = io.BytesIO()
    torch.save(torch.arange(3.0).untyped_storage(), good)
    storage = unpickle_tensors(pickle.dumps(StorageFromBytes(good.getvalue())), what="entry")
    values = torch.tensor([], dtype=torch.uint8).set_(storage).view(torch.float32)
    assert torch.equal(values, torch.arange(3.0))


def share(obj: object) -> str:
    torch.multiprocessing.set_sharing_strategy("file_system")
    return serialize(obj)


@pytest.mark.parametrize("how", ["shared", "plain"])
def test_tensors_come_back_equal_whichever_way_torch_pickled_them(how) -> None:
    pairs = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)),
             ("p", torch.nn.Parameter(torch.randn(2))), ("e", torch.empty(0))]
    data = share(pairs) if how == "shared" else b64(pickle.dumps(pairs))
    got = named_tensors([data], None)
    assert [n for n, _ in got] == [n for n, _ in pairs]
    for (_, want), (_, have) in zip(pairs, got, strict=True):
        assert have.dtype == want.dtype and torch.equal(have, want.detach())


def test_a_storage_shared_by_file_descriptor_is_refused_with_the_fix() -> None:
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump([("a", torch.ones(2))])
    finally:
        torch.multiprocessing.set_sharing_strategy("file_system")
    with pytest.raises(WeightSyncError, match="set_sharing_strategy\\('file_system'\\)"):
        named_tensors([b64(buf.getvalue())], None)


@pytest.mark.parametrize("as_bytes", [True, False])
def test_a_flattened_bucket_gives_back_every_tensor(as_bytes) -> None:
    metadata = sglang_metadata_class()
    pairs = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)),
             ("c", torch.randn(2, 3))]
    if not as_bytes:  # the older writer: one dtype per bucket
        pairs = [(n, t.float()) for n, t in pairs]
    got = named_tensors([share(flattened_bucket(pairs, metadata, as_bytes))],
                        "flattened_bucket")
    assert [n for n, _ in got] == ["a", "b", "c"]
    for (_, want), (_, have) in zip(pairs, got, strict=True):
        assert have.dtype == want.dtype and torch.equal(have, want)


@pytest.mark.parametrize(("fault", "message"), [
    ("past_the_end", "runs outside the flattened tensor"),
    ("wrong_shape", "bytes for shape"),
    ("mistyped", "FlattenedTensorMetadata.start_idx is str"),
    ("keys", "a flattened bucket is"),
])
def test_a_malformed_bucket_is_refused_naming_the_entry(fault, message) -> None:
    metadata = sglang_metadata_class()
    bucket = flattened_bucket([("a", torch.randn(3, 4)), ("b", torch.randn(2))], metadata,
                              as_bytes=True)
    entry = bucket["metadata"][1]
    if fault == "past_the_end":
        entry.end_idx += 64
    elif fault == "wrong_shape":
        entry.shape = torch.Size([3])
    elif fault == "mistyped":
        entry.start_idx = "48"
    else:
        bucket["extra"] = 1
    with pytest.raises(WeightSyncError, match=message):
        named_tensors([share(bucket)], "flattened_bucket")


def test_an_empty_bucket_holds_no_tensor_and_an_unknown_load_format_is_refused() -> None:
    assert bucket_tensors({"flattened_tensor": torch.empty(0, dtype=torch.uint8),
                           "metadata": []}) == []
    with pytest.raises(WeightSyncError, match="load_format 'safetensors'"):
        named_tensors(["x"], "safetensors")
    with pytest.raises(WeightSyncError, match="not base64"):
        named_tensors(["not base64!"], None)
