"""``forbid_host_reads`` catches, on the CPU, every way code hands a tensor's value to
the host (each a wait for the device on CUDA), and lets device-side code through."""

from __future__ import annotations

import pytest
import torch

from kvrunner.testing.host_reads import HostReadError, allow_host_reads, forbid_host_reads

T = torch.tensor([3, 0, 5])
MASK = T > 0
ZERO_DIM = torch.tensor(1)

READS = {
    "item": lambda: T[0].item(),
    "int of a tensor": lambda: int(T[1]),
    "bool of a tensor": lambda: bool(T[1] > 0),
    "index by a 0-dim tensor": lambda: T[ZERO_DIM],
    "nonzero": lambda: T.nonzero(),
    "one-argument where": lambda: torch.where(MASK),
    "boolean mask": lambda: T[MASK],
    "masked_select": lambda: T.masked_select(MASK),
    "unique": lambda: torch.unique(T),
    "repeat_interleave without output_size": lambda: torch.repeat_interleave(T, T),
    "equal": lambda: torch.equal(T, T),
    "tolist": lambda: T.tolist(),
    "numpy": lambda: T.numpy(),
    "cpu": lambda: T.cpu(),
}
DEVICE_SIDE = {
    "three-argument where": lambda: torch.where(MASK, T, 0),
    "index_select by a 1-element tensor": lambda: T.index_select(0, ZERO_DIM.view(1)),
    "index by a long tensor": lambda: T[torch.tensor([0, 2])],
    "repeat_interleave with output_size": lambda: torch.repeat_interleave(T, T, output_size=8),
    "arithmetic and reductions": lambda: (T * MASK).sum() + T.max(),
    "slicing": lambda: T[1:],
}


@pytest.mark.parametrize("read", sorted(READS))
def test_each_way_of_reading_a_value_on_the_host_is_caught_and_named(read: str) -> None:
    with (
        pytest.raises(HostReadError, match="the code under test read a tensor's value"),
        forbid_host_reads("the code under test"),
    ):
        READS[read]()


@pytest.mark.parametrize("op", sorted(DEVICE_SIDE))
def test_code_that_keeps_values_on_the_device_passes(op: str) -> None:
    with forbid_host_reads():
        result = DEVICE_SIDE[op]()  # the guard lets it through: no HostReadError
    assert torch.equal(result, DEVICE_SIDE[op]())  # and it computed what it computes unguarded


def test_allow_host_reads_suspends_the_guard_for_a_stand_in_only() -> None:
    with forbid_host_reads():
        with allow_host_reads():
            assert T.tolist() == [3, 0, 5] and T[0].item() == 3
        with pytest.raises(HostReadError):
            T[0].item()
    assert T[0].item() == 3  # nothing is guarded outside
