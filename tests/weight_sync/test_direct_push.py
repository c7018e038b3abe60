"""A direct push from a trainer in another process: the engine copies straight out of
the trainer tensors' own storages (shared memory on the CPU: the CUDA IPC protocol
run for real), keeps them mapped across pushes, and lands every push whole or
refuses to serve.

The trainer holds a transformers checkpoint's tensors as a trainer might (some
owning their storage, some views at odd offsets into one flat storage, some
non-contiguous, which are packed into a bucket instead); after a push the engine's
greedy tokens equal transformers' on the pushed weights (rounded to the dtype the
trainer held them in).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from push_kit import assert_refusing, tokens

from kvrunner import LLM
from kvrunner.weight_sync import WeightSyncError

#: every tensor of the untied 2-layer checkpoint
TENSORS = 2 + 2 * 11 + 1


def push(llm: LLM, trainer, **job) -> dict:
    """One direct push; returns what the sender says it sent."""
    address, authkey = trainer.start(mode="direct", **job)
    loaded = llm.update_weights_from_ipc(address, authkey=authkey, timeout_s=30)
    kind, answered, stats = trainer.result()
    assert (kind, answered) == ("pushed", loaded)
    assert loaded == TENSORS
    assert stats["shared"] + stats["packed"] == TENSORS
    return stats


@given(
    seed=st.sampled_from([2, 3]),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    cast=st.booleans(),
    order_seed=st.integers(0, 2**16),
    layout_seed=st.integers(0, 2**16),
    chunk_bytes=st.sampled_from([1, 64 << 10, 1 << 30]),
    tp=st.sampled_from([1, 2]),
)
def test_after_a_direct_push_the_engine_generates_what_transformers_does_on_the_pushed_weights(
    llm, llm_tp2, trainer, checkpoints, seed, dtype, cast, order_seed, layout_seed,
    chunk_bytes, tp
) -> None:
    llm = llm if tp == 1 else llm_tp2
    # cast: the trainer holds float32 and the sender casts to dtype (so packs those)
    held = dict(dtype="float32", cast=dtype) if cast else dict(dtype=dtype)
    stats = push(llm, trainer, path=checkpoints.path(seed), order_seed=order_seed,
                 layout_seed=layout_seed, chunk_bytes=chunk_bytes, **held)
    if cast and dtype != "float32":
        assert stats["shared"] == 0  # every tensor is cast while packed
    assert llm.cache_info().weights == "resident"
    assert tokens(llm) == checkpoints.expected(seed, dtype)


def test_a_push_after_an_in_place_update_lands_the_new_values_sending_only_metadata(
    llm, trainer, checkpoints
) -> None:
    first = push(llm, trainer, path=checkpoints.path(2), layout_seed=5, chunk_bytes=64 << 10)
    assert first["new_storages"] > 0 and first["shared"] > 0
    assert tokens(llm) == checkpoints.expected(2, "float32")
    # the optimizer's step: the same storages, new values; the engine reads them in
    # its mappings from the first push (a cached mapping that skipped its copy, or
    # read a stale copy, would still generate seed 2's tokens)
    for seed in (3, 2, 3):
        again = push(llm, trainer, path=checkpoints.path(seed), in_place=True)
        assert again["new_storages"] == 0 and again["shared"] == first["shared"]
        assert tokens(llm) == checkpoints.expected(seed, "float32")


def test_a_tensor_given_a_new_storage_between_pushes_is_shared_afresh_and_lands(
    llm, trainer, checkpoints
) -> None:
    push(llm, trainer, path=checkpoints.path(2), layout_seed=9)
    assert tokens(llm) == checkpoints.expected(2, "float32")
    # some tensors now live in new storages (a parameter re-allocated): the engine
    # must read those, not the old storages it still has mapped
    again = push(llm, trainer, path=checkpoints.path(3), in_place=True, replace_every=3)
    assert 0 < again["new_storages"] <= 9  # tensors 0, 3, ..., 24 (those shared)
    assert tokens(llm) == checkpoints.expected(3, "float32")
    # the engine keeps exactly the storages the push named: those left behind by the
    # replaced tensors (and no longer used by any other) were unmapped
    assert llm._mapped_storages.held()[again["sender"]] == again["storages"]


def test_closing_the_sender_unmaps_its_storages_so_the_trainer_can_free_them(
    llm, fresh_trainer, checkpoints
) -> None:
    stats = push(llm, fresh_trainer, path=checkpoints.path(2), layout_seed=3)
    assert llm._mapped_storages.held()[stats["sender"]] == stats["storages"]
    fresh_trainer.conn.send({"mode": "close"})
    kind, segments = fresh_trainer.result()
    assert kind == "closed" and segments
    assert stats["sender"] not in llm._mapped_storages.held()
    # the trainer dropped its tensors: with the engine's mappings gone, their shared
    # memory is unlinked
    leftover = [s for s in segments if os.path.exists("/dev/shm/" + s.lstrip("/"))]
    assert leftover == []


def test_a_trainer_killed_mid_direct_push_leaves_the_engine_refusing_until_a_full_push(
    llm, fresh_trainer, trainer, checkpoints
) -> None:
    address, authkey = fresh_trainer.start(mode="direct", path=checkpoints.path(2),
                                           die_after=12, chunk_bytes=1)
    with pytest.raises(WeightSyncError, match="closed the connection|refused"):
        llm.update_weights_from_ipc(address, authkey=authkey, timeout_s=30)
    assert_refusing(llm)  # the first messages had loaded
    push(llm, trainer, path=checkpoints.path(3), layout_seed=1)
    assert llm.cache_info().weights == "resident"
    assert tokens(llm) == checkpoints.expected(3, "float32")


@pytest.mark.parametrize(("fault", "message"), [
    ("unmapped", "storage 99 is not mapped"),
    ("past_the_end", "run past the end"),
    ("no_sender", "whose Begin named no sender"),
])
def test_a_malformed_direct_message_is_refused_by_name_and_the_engine_refuses_until_a_full_push(
    llm, trainer, checkpoints, fault, message
) -> None:
    address, authkey = trainer.start(path=checkpoints.path(3), fault="direct_" + fault)
    with pytest.raises(WeightSyncError, match=message):
        llm.update_weights_from_ipc(address, authkey=authkey, timeout_s=30)
    kind, said = trainer.result()
    assert kind == "failed" and message.split(" ")[0] in said  # the trainer hears why
    assert_refusing(llm)  # message 0 had loaded
    push(llm, trainer, path=checkpoints.path(3))
    assert tokens(llm) == checkpoints.expected(3, "float32")
