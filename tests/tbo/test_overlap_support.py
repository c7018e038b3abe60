"""The ``supports_overlap`` contract: the core refuses an overlap plugin over a layer
backend that does not declare it, and what a declaring backend may keep its metadata
in (attrs, dataclasses, tuples, lists, dicts) is what tbo mirrors."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import attrs
import pytest
import torch
from kvrunner_tbo.mirrors import Mirrors

from kvrunner import LLM, SamplingParams
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.plugin_api import (
    BackendError,
    CacheWriteTarget,
    ForwardContext,
    map_tensors,
    unwalked_tensors,
)
from kvrunner.plugin_host.plugins import register_backend, unregister_backend
from kvrunner.testing.harness import backend_manager, small_model_spec
from kvrunner_paged import PagedBackend


class Undeclared(PagedBackend):
    """``paged`` as a backend that makes no promise to an overlap plugin."""

    supports_overlap = False


@pytest.fixture
def undeclared():
    register_backend("undeclared", Undeclared)
    yield "undeclared"
    unregister_backend("undeclared")


def test_the_manager_refuses_an_overlap_plugin_over_an_undeclared_backend(undeclared) -> None:
    with pytest.raises(BackendError, match=r"overlap plugin 'tbo' cannot run over backend "
                                           r"'undeclared'.*supports_overlap"):
        backend_manager({"full_attention": undeclared}, small_model_spec(), overlap="tbo")
    backend_manager({"full_attention": undeclared}, small_model_spec())  # alone it is fine


def test_llm_refuses_tbo_over_an_undeclared_backend_naming_both(undeclared, tmp_path) -> None:
    model = str(write_tiny_checkpoint(tmp_path / "tiny", kind="qwen3", seed=0))
    settings = dict(model=model, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                    block_size=4, num_blocks=32, full_attention=undeclared)
    with pytest.raises(BackendError, match=r"'tbo'.*'undeclared'"):
        LLM(**settings, overlap="tbo")
    with LLM(**settings) as llm:  # the refusal left nothing behind
        assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].token_ids) == 2


@attrs.frozen
class AttrsMd:
    slots: torch.Tensor


@dataclasses.dataclass
class DataMd:
    slots: torch.Tensor


Pair = namedtuple("Pair", "slots other")


class Opaque:
    def __init__(self, slots: torch.Tensor) -> None:
        self.slots = slots


@pytest.mark.parametrize("wrap", [
    lambda t: AttrsMd(t), lambda t: DataMd(t), lambda t: (t,), lambda t: [t],
    lambda t: {"slots": t}, lambda t: Pair(t, 3), lambda t: {"inner": [AttrsMd(t)]},
])
def test_tbo_mirrors_a_write_target_in_every_walkable_container(wrap) -> None:
    slots = torch.tensor([3, 4, -1, -1], dtype=torch.int64)
    target = CacheWriteTarget(name="slot_mapping", buffer=slots, backend="b")
    mirrors = Mirrors([target])
    ctx = mirrors.relocate(0, ForwardContext(metadata={"b": wrap(slots)}), (), capture=False)
    found = []
    map_tensors(ctx.metadata["b"], lambda _, t: found.append(t) or t)
    (mirror,) = found
    assert mirror.untyped_storage().data_ptr() != slots.untyped_storage().data_ptr()
    assert torch.equal(mirror, slots)
    assert unwalked_tensors(wrap(slots)) == []


def test_a_tensor_inside_an_object_the_walk_does_not_enter_is_named() -> None:
    slots = torch.zeros(4, dtype=torch.int64)
    assert unwalked_tensors({"b": [Opaque(slots)]}, "md") == [
        "md['b'][0]: a Opaque holding tensors ['slots']"
    ]
