"""A push from a trainer in another process (shared memory on the CPU: the CUDA IPC
protocol run for real) lands whole, or leaves the engine refusing to serve.

The engine starts from one transformers checkpoint and is pushed another; after the
push its greedy tokens equal transformers' on the pushed weights (rounded to the
dtype they travelled in).
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from push_kit import assert_refusing, tokens

from kvrunner import LLM
from kvrunner.errors import SleepStateError
from kvrunner.weight_sync import WeightSyncError, receiver

#: the largest tensor of the test model (the 512 x 64 float32 embedding) fits exactly
SMALLEST_BUCKET = 512 * 64 * 4


def push(llm: LLM, trainer, **job) -> int:
    address, authkey = trainer.start(**job)
    loaded = llm.update_weights_from_ipc(address, authkey=authkey, timeout_s=30)
    assert trainer.result() == ("pushed", loaded)
    return loaded


@given(
    seed=st.sampled_from([2, 3]),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    bucket_bytes=st.integers(SMALLEST_BUCKET, 3 * SMALLEST_BUCKET),
    order_seed=st.integers(0, 2**16),
    tp=st.sampled_from([1, 2]),
)
def test_after_a_push_the_engine_generates_what_transformers_does_on_the_pushed_weights(
    llm, llm_tp2, trainer, checkpoints, seed, dtype, bucket_bytes, order_seed, tp
) -> None:
    llm = llm if tp == 1 else llm_tp2
    loaded = push(llm, trainer, path=checkpoints.path(seed), dtype=dtype,
                  bucket_bytes=bucket_bytes, order_seed=order_seed)
    assert loaded == 2 + 2 * 11 + 1  # every tensor of the untied 2-layer checkpoint
    assert llm.cache_info().weights == "resident"
    assert tokens(llm) == checkpoints.expected(seed, dtype)


def test_a_bucket_is_acknowledged_only_after_its_copy_so_reused_buffers_never_corrupt(
    llm, trainer, checkpoints, monkeypatch
) -> None:
    # A copy that takes a while (as an asynchronous device copy does): were the bucket
    # acknowledged before it finished, the sender would refill the buffer under it.
    real = receiver.copy_bucket
    monkeypatch.setattr(receiver, "copy_bucket",
                        lambda load, pairs: (time.sleep(0.05), real(load, pairs))[1])
    push(llm, trainer, path=checkpoints.path(3), bucket_bytes=SMALLEST_BUCKET, order_seed=1)
    assert tokens(llm) == checkpoints.expected(3, "float32")


def test_a_trainer_killed_mid_push_leaves_the_engine_refusing_until_a_full_push(
    llm, fresh_trainer, trainer, checkpoints
) -> None:
    address, authkey = fresh_trainer.start(path=checkpoints.path(2), die_after=12,
                                           bucket_bytes=SMALLEST_BUCKET)
    with pytest.raises(WeightSyncError, match="closed the connection|refused"):
        llm.update_weights_from_ipc(address, authkey=authkey, timeout_s=30)
    assert_refusing(llm)
    push(llm, trainer, path=checkpoints.path(2), bucket_bytes=SMALLEST_BUCKET)
    assert llm.cache_info().weights == "resident"
    assert tokens(llm) == checkpoints.expected(2, "float32")


@pytest.mark.parametrize(("fault", "message"), [
    ("past_the_end", "run past the end"),
    ("unknown_dtype", "dtype 'int8' is not one of"),
    ("wrong_shape", "expected shape"),
    ("wrong_name", "no parameter 'model.nope.weight'"),
    ("overlap", "overlap"),
    ("not_a_bucket", "expected a Bucket, Shared or End"),
    ("nan", "bucket 1: tensor '.+' holds NaN or inf values"),
    ("inf", "bucket 1: tensor '.+' holds NaN or inf values"),
])
def test_a_malformed_bucket_is_refused_by_name_and_the_engine_refuses_until_a_full_push(
    llm, trainer, checkpoints, fault, message
) -> None:
    address, authkey = trainer.start(path=checkpoints.path(3), fault=fault)
    with pytest.raises(WeightSyncError, match=message):
        llm.update_weights_from_ipc(address, authkey=authkey, timeout_s=30)
    kind, said = trainer.result()
    assert kind == "failed" and message.split("'")[0] in said  # the trainer hears why
    assert_refusing(llm)  # bucket 0 had loaded
    push(llm, trainer, path=checkpoints.path(3), bucket_bytes=4 * SMALLEST_BUCKET)
    assert tokens(llm) == checkpoints.expected(3, "float32")


def test_a_refusal_after_a_loaded_bucket_says_which_calls_serve_again(
    llm, trainer, checkpoints
) -> None:
    address, authkey = trainer.start(path=checkpoints.path(3), fault="wrong_shape")
    with pytest.raises(WeightSyncError) as refused:
        llm.update_weights_from_ipc(address, authkey=authkey, timeout_s=30)
    trainer.result()
    message = str(refused.value)
    assert "the weights are partial" in message
    assert "update_weights_from_ipc" in message and "load_weights(path)" in message
    push(llm, trainer, path=checkpoints.path(3), bucket_bytes=4 * SMALLEST_BUCKET)


def test_a_bucket_is_judged_whole_before_any_of_it_loads(llm, trainer, checkpoints) -> None:
    """Bucket 0 holds a good tensor and then one of a wrong shape: neither loads, so
    the engine, refused by the first bucket, serves its old weights on."""
    push(llm, trainer, path=checkpoints.path(2), bucket_bytes=4 * SMALLEST_BUCKET)
    before = tokens(llm)
    address, authkey = trainer.start(path=checkpoints.path(3),
                                     fault="first_bucket_wrong_shape")
    with pytest.raises(WeightSyncError, match="bucket 0: .*expected"):
        llm.update_weights_from_ipc(address, authkey=authkey, timeout_s=30)
    assert trainer.result()[0] == "failed"
    assert llm.cache_info().weights == "resident"
    assert tokens(llm) == before == checkpoints.expected(2, "float32")


def test_the_trainer_hears_the_engines_refusal_when_the_engine_is_asleep(
    llm, trainer, checkpoints
) -> None:
    llm.sleep(2)  # the weights offloaded: a push must wait for wake_up
    try:
        address, authkey = trainer.start(path=checkpoints.path(2), bucket_bytes=SMALLEST_BUCKET)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pushing = pool.submit(llm.update_weights_from_ipc, address, authkey=authkey)
            kind, said = trainer.result()
            with pytest.raises(SleepStateError, match="wake_up"):
                pushing.result()
        assert kind == "failed" and "refused" in said
    finally:
        llm.wake_up()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bucket_check_names_a_non_finite_tensor_and_passes_huge_finite_ones(dtype) -> None:
    """One pass over the whole bucket finds a NaN or an infinity anywhere, and the
    per-tensor check then names it; values whose sum overflows, all finite, pass."""
    pairs = [(f"t{i}", torch.randn(50).to(dtype)) for i in range(6)] + [("empty", torch.ones(0))]
    receiver.check_finite(pairs, "bucket 0")
    receiver.check_finite([("huge", torch.full((4,), 3e38).to(dtype)), *pairs], "bucket 0")
    for bad in (float("nan"), float("inf"), float("-inf")):
        spoiled = [(name, t.clone()) for name, t in pairs]
        spoiled[3][1][17] = bad
        with pytest.raises(WeightSyncError, match="bucket 0: tensor 't3' holds NaN or inf"):
            receiver.check_finite(spoiled, "bucket 0")
