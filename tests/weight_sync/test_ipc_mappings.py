"""One rank's IPC mappings within a weight update: torch opens each share once,
however often the trainer sends it, and the update's end lets every mapping go.

No CPU can open a CUDA IPC handle, so torch's rebuild is stood in for by one that
hands out a CPU storage per call and counts the calls; the release torch makes when
a mapping is freed is what test_peer_push_memory_gpu.py measures on a GPU."""

from __future__ import annotations

import pytest
import torch
from vllm_ipc_payloads import cuda_args

from kvrunner.weight_sync import ipc_mappings
from kvrunner.weight_sync.ipc_mappings import IpcMappings


@pytest.fixture
def opened(monkeypatch) -> list[torch.Tensor]:
    """Every tensor the stand-in rebuild made (a fresh 64-byte storage each call)."""
    made: list[torch.Tensor] = []

    def rebuild(args, device, where):
        tensor = torch.arange(64, dtype=torch.uint8)
        made.append(tensor)
        return tensor.view(args[5]).view(args[1])

    monkeypatch.setattr(ipc_mappings, "_rebuild", rebuild)
    return made


def share(slot: int) -> tuple:
    """Rebuild arguments of one 64-byte buffer shared with counter slot ``slot``."""
    args = list(cuda_args([64], torch.uint8))
    args[12] = slot
    return tuple(args)


def test_a_share_sent_again_is_a_view_of_the_mapping_already_open(opened):
    mappings = IpcMappings()
    first = mappings.open(share(0), torch.device("cpu"), "chunk 0")
    again = mappings.open(share(0), torch.device("cpu"), "chunk 1")
    assert len(opened) == 1, "torch opened the same share twice"
    assert again.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    assert torch.equal(again, first)


def test_another_share_of_the_same_buffer_is_opened_by_torch(opened):
    mappings = IpcMappings()
    mappings.open(share(0), torch.device("cpu"), "push 0")
    mappings.open(share(1), torch.device("cpu"), "push 1")
    assert len(opened) == 2 and len(mappings) == 2


def test_a_view_keeps_the_shape_stride_and_offset_its_handle_names(opened):
    mappings = IpcMappings()
    mappings.open(share(0), torch.device("cpu"), "buffer")
    args = list(share(0))
    args[1], args[2], args[3] = torch.Size([4, 8]), (8, 1), 16
    view = mappings.open(tuple(args), torch.device("cpu"), "a tensor inside it")
    assert view.shape == (4, 8) and view.stride() == (8, 1)
    assert view.storage_offset() == 16 and view[0, 0].item() == 16


def test_release_lets_go_of_every_mapping(opened):
    mappings = IpcMappings()
    mappings.open(share(0), torch.device("cpu"), "chunk")
    mappings.open(share(1), torch.device("cpu"), "chunk")
    mappings.release()
    assert len(mappings) == 0
    mappings.open(share(0), torch.device("cpu"), "the next update's chunk")
    assert len(opened) == 3, "a share released at the end of an update was kept open"


def test_a_buffer_the_next_call_does_not_name_is_let_go_and_one_it_names_is_kept(opened):
    mappings = IpcMappings()
    mappings.open(share(0), torch.device("cpu"), "chunk 0 (vLLM's buffer)")
    mappings.open(share(1), torch.device("cpu"), "chunk 0 (SkyRL's first buffer)")
    mappings.keep_only_named()
    mappings.open(share(0), torch.device("cpu"), "chunk 1 (the same buffer)")
    mappings.open(share(2), torch.device("cpu"), "chunk 1 (SkyRL's next buffer)")
    mappings.keep_only_named()
    assert len(mappings) == 2, "the first call's buffer outlived the call after it"
    mappings.open(share(0), torch.device("cpu"), "chunk 2")
    assert len(opened) == 3, "a buffer kept open was opened by torch again"
