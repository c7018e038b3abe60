"""vLLM's packed chunks (``pack_tensors``'s rule, vllm-project/vllm
00a9ccfb4cefdaf0092392b0afba5721b33886e6): tensors are appended in order and a chunk
is closed once its size passes the buffer, so a chunk always holds at least one
tensor; unpacking gives each tensor back bit for bit."""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from kvrunner.models.weight_specs import TensorSpec
from kvrunner.weight_sync.packed_broadcast import packed_chunks


def spec(name: str, numel: int, dtype: str = "float32") -> TensorSpec:
    return TensorSpec(name, (numel,), dtype, True)


def test_a_chunk_closes_once_it_passes_the_buffer_not_before() -> None:
    specs = [spec("a", 2), spec("b", 2), spec("c", 1), spec("d", 8)]  # 8, 8, 4, 32 bytes
    chunks = packed_chunks(specs, 16)
    # 8 + 8 = 16 does not pass 16; + 4 = 20 does; d alone passes it
    assert [[s.name for s in c.specs] for c in chunks] == [["a", "b", "c"], ["d"]]
    assert [c.nbytes for c in chunks] == [20, 32]


@given(st.lists(st.tuples(st.integers(0, 9), st.sampled_from(["float32", "bfloat16"])),
                min_size=1, max_size=12), st.integers(1, 64))
@example([(1, "bfloat16"), (3, "float32")], 64)  # float32 bytes at an offset of 2
def test_unpacking_the_concatenated_bytes_gives_every_tensor_back(sizes, buffer) -> None:
    tensors = [(f"t{i}", torch.randn(n).to(getattr(torch, dtype)))
               for i, (n, dtype) in enumerate(sizes)]
    specs = [TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), True)
             for n, t in tensors]
    got = []
    at = 0
    for chunk in packed_chunks(specs, buffer):
        assert chunk.specs  # never an empty broadcast
        flat = torch.cat([t.view(torch.uint8) for _, t in tensors[at:at + len(chunk.specs)]])
        got += chunk.unpack(flat)
        at += len(chunk.specs)
    assert [n for n, _ in got] == [n for n, _ in tensors]
    for (_, a), (_, b) in zip(got, tensors, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
