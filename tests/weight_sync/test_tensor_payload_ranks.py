"""SGLang's ``serialized_named_tensors`` hold one payload per tensor-parallel rank, and
rank ``r`` opens entry ``r`` (as SGLang's schedulers do): a TP=2 engine given two
payloads loads and generates as transformers on the pushed weights; a fault in entry
1 alone (a value, a payload the unpickler refuses) is refused naming entry 1; entries
holding different tensors, or a count of entries other than the TP size, are refused
naming what differs. Every refusal comes before any rank loads: the old weights serve
on, not ``partial``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from push_kit import tokens
from trainer_process import checkpoint_tensors

from kvrunner.weight_sync import WeightSyncError

sys.path.insert(0, str(Path(__file__).parent))
from peer_trainers import serialize  # noqa: E402


@pytest.fixture
def shared_by_file_name() -> Iterator[None]:
    """SGLang's senders share CPU tensors by file name, which the ranks' processes open."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    yield
    torch.multiprocessing.set_sharing_strategy(before)


def entry(pairs: list[tuple[str, torch.Tensor]]) -> str:
    """One rank's payload: its own copies of the tensors (as each trainer rank holds
    its own), serialized as SGLang's MultiprocessingSerializer does."""
    return serialize([(name, tensor.clone()) for name, tensor in pairs])


def test_each_rank_of_a_tp2_engine_loads_its_own_entry(
    llm_tp2, checkpoints, shared_by_file_name
) -> None:
    pairs = checkpoint_tensors(str(checkpoints.path(2)), 0)
    assert llm_tp2.update_weights_from_tensor([entry(pairs), entry(pairs)],
                                              weight_version="two") == len(pairs)
    assert llm_tp2.weight_version == "two"
    assert tokens(llm_tp2) == checkpoints.expected(2, "float32")
    llm_tp2.load_weights(checkpoints.path(1))


@pytest.mark.parametrize("fault", ["nan", "hostile", "not_base64"])
def test_a_fault_in_entry_1_alone_is_refused_naming_it_and_nothing_loads(
    llm_tp2, checkpoints, shared_by_file_name, fault, tmp_path
) -> None:
    """Entry 1 is opened and judged by rank 1: a fault there alone refuses the update."""
    from test_tensor_unpickler import RunsACommand

    llm_tp2.load_weights(checkpoints.path(1))
    before = tokens(llm_tp2)
    pairs = checkpoint_tensors(str(checkpoints.path(2)), 0)
    name, tensor = pairs[3]
    if fault == "nan":
        poisoned = tensor.clone()
        poisoned.view(-1)[0] = float("nan")
        second = entry([*pairs[:3], (name, poisoned), *pairs[4:]])
        expected = rf"serialized_named_tensors\[1\]: tensor '{name}' holds NaN"
    elif fault == "hostile":
        import base64
        import pickle

        second = base64.b64encode(pickle.dumps([(name, RunsACommand(tmp_path / "ran"))])
                                  ).decode()
        expected = r"serialized_named_tensors\[1\].*posix\.system"
    else:
        second, expected = "not base64!", r"serialized_named_tensors\[1\]"
    with pytest.raises(WeightSyncError, match=expected):
        llm_tp2.update_weights_from_tensor([entry(pairs), second])
    assert not (tmp_path / "ran").exists()
    assert llm_tp2.cache_info().weights == "resident"
    assert tokens(llm_tp2) == before


def test_entries_holding_different_tensors_are_refused_naming_the_first_difference(
    llm_tp2, checkpoints, shared_by_file_name
) -> None:
    """kvrunner's ranks each take a shard of every tensor: an entry lacking one (a
    trainer routing experts to an expert-parallel engine's ranks) would leave that
    rank's shard of it old."""
    llm_tp2.load_weights(checkpoints.path(1))
    before = tokens(llm_tp2)
    pairs = sorted(checkpoint_tensors(str(checkpoints.path(2)), 0))
    with pytest.raises(WeightSyncError, match=rf"\[0\] and \[1\] hold different tensors "
                                              rf"\(first: '{pairs[0][0]}': .* vs absent\)"):
        llm_tp2.update_weights_from_tensor([entry(pairs), entry(pairs[1:])])
    assert llm_tp2.cache_info().weights == "resident"
    assert tokens(llm_tp2) == before


@pytest.mark.parametrize(("engine", "count"), [("llm_tp2", 1), ("llm_tp2", 3), ("llm", 2)])
def test_a_count_of_entries_other_than_the_tp_size_is_refused_naming_both(
    request, engine, count, checkpoints, shared_by_file_name
) -> None:
    llm = request.getfixturevalue(engine)
    tp = llm.config.parallel.tensor_parallel_size
    version = llm.weight_version
    pairs = checkpoint_tensors(str(checkpoints.path(2)), 0)
    with pytest.raises(WeightSyncError, match=rf"has {count} entries, but the engine has "
                                              rf"{tp} tensor-parallel ranks"):
        llm.update_weights_from_tensor([entry(pairs) for _ in range(count)])
    assert llm.cache_info().weights == "resident"
    assert llm.weight_version == version
