"""Weights broadcast over a weight-update group (gloo on the CPU) from a trainer's
rank 0 in another process: TP=1 and TP=2 engines receive full tensors, keep their
shards and generate what transformers does; a trainer that dies mid-push leaves the
engine refusing until a full push."""

from __future__ import annotations

import socket

import pytest
from test_generate_hf_parity import NEW_TOKENS, PROMPTS
from trainer_process import checkpoint_tensors

from kvrunner import LLM, SamplingParams
from kvrunner.errors import SleepStateError
from kvrunner.weight_sync import WeightSyncError
from kvrunner.weight_sync.broadcaster import WeightBroadcaster

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=64,
              block_size=4)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def joined(llm: LLM, trainer, path, **job) -> None:
    """The trainer (rank 0) and every engine rank in a fresh group."""
    tp = llm.config.parallel.tensor_parallel_size
    port = free_port()
    trainer.conn.send({"path": str(path), "port": port, "world_size": 1 + tp, **job})
    llm.init_weights_update_group("127.0.0.1", port, 1, 1 + tp, backend="gloo",
                                  timeout_s=30)
    assert trainer.result()[0] == "joined"


@pytest.fixture(scope="module")
def llm_tp1(checkpoints):
    engine = LLM(model=str(checkpoints.path(1)), **ENGINE)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("engine", ["llm_tp1", "llm_tp2"])
def test_a_broadcast_push_lands_in_every_rank_and_generates_as_transformers(
    request, engine, trainer, checkpoints
) -> None:
    llm = request.getfixturevalue(engine)
    joined(llm, trainer, checkpoints.path(2), order_seed=3)
    names, dtypes, shapes = WeightBroadcaster.spec(checkpoint_tensors(str(checkpoints.path(2)),
                                                                      3))
    assert llm.update_weights_from_distributed(names, dtypes, shapes) == len(names)
    assert trainer.result()[0] == "broadcast"
    llm.destroy_weights_update_group()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == \
        checkpoints.expected(2, "float32")


def test_a_trainer_dying_mid_broadcast_leaves_the_engine_refusing_until_a_full_push(
    llm_tp1, fresh_trainer, trainer, checkpoints
) -> None:
    path = str(checkpoints.path(3))
    spec = WeightBroadcaster.spec(checkpoint_tensors(path, 0))
    joined(llm_tp1, fresh_trainer, path, die_after=10)
    with pytest.raises(WeightSyncError, match="broadcast"):
        llm_tp1.update_weights_from_distributed(*spec)
    assert llm_tp1.cache_info().weights == "partial"
    with pytest.raises(SleepStateError, match="failed part way"):
        llm_tp1.generate(PROMPTS, GREEDY)
    joined(llm_tp1, trainer, path)
    llm_tp1.update_weights_from_distributed(*spec)
    assert trainer.result()[0] == "broadcast"
    assert [o.token_ids for o in llm_tp1.generate(PROMPTS, GREEDY)] == \
        checkpoints.expected(3, "float32")


@pytest.mark.parametrize(("engine", "index", "kind"), [
    ("llm_tp1", 5, "longer"),    # after 5 tensors loaded: partial, repair named
    ("llm_tp1", 0, "shorter"),   # the first tensor: nothing loaded, old weights serve
    ("llm_tp2", 0, "longer"),
])
def test_a_broadcast_of_another_size_than_announced_is_refused_and_the_engine_serves_on(
    request, engine, index, kind, fresh_trainer, trainer, checkpoints
) -> None:
    """gloo would end the receiving process (a longer broadcast) or fill part of its
    buffer silently (a shorter one); the engine refuses naming the tensor and both
    sizes, leaves the group, and serves on (this process is a TP=1 engine's rank)."""
    llm = request.getfixturevalue(engine)
    llm.load_weights(checkpoints.path(1))
    before = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    path = str(checkpoints.path(3))
    pairs = checkpoint_tensors(path, 0)
    name, tensor = pairs[index]
    announced = tensor.numel() * 4
    sent = announced * 2 if kind == "longer" else announced - 4
    joined(llm, fresh_trainer, path, resize=(index, kind))
    with pytest.raises(WeightSyncError, match=rf"tensor '{name}' .*: the trainer broadcast "
                                              rf"{sent} bytes where {announced} were announced"):
        llm.update_weights_from_distributed(*WeightBroadcaster.spec(pairs))
    if index == 0:
        assert llm.cache_info().weights == "resident"
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == before
    else:
        assert llm.cache_info().weights == "partial"
    with pytest.raises(WeightSyncError, match="left its weight-update group"):
        llm.update_weights_from_distributed(*WeightBroadcaster.spec(pairs))
    joined(llm, trainer, path)  # the repair: join again, push everything
    assert llm.update_weights_from_distributed(*WeightBroadcaster.spec(pairs)) == len(pairs)
    assert trainer.result()[0] == "broadcast"
    llm.destroy_weights_update_group()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == \
        checkpoints.expected(3, "float32")


def test_the_announced_names_and_shapes_are_judged_before_the_first_broadcast() -> None:
    """A group push names every tensor up front: a refusal there is raised before a
    broadcast is received (this group has none to give: receiving would fail)."""
    import torch

    from kvrunner.errors import WeightUpdateError
    from kvrunner.weight_sync.update_group import UpdateGroup

    judged: list = []

    def refuse(specs) -> None:
        judged.extend(specs)
        raise WeightUpdateError("tensor 'model.nope.weight': no such parameter")

    def load(pairs) -> int:
        raise AssertionError("nothing may load")

    group = UpdateGroup(None, torch.device("cpu"))
    with pytest.raises(WeightUpdateError, match="model.nope.weight"):
        group.receive(["model.norm.weight", "model.nope.weight"], ["float32", "bfloat16"],
                      [[64], [2, 2]], load, check=refuse)
    assert [(s.name, s.shape, s.dtype) for s in judged] == [
        ("model.norm.weight", (64,), "float32"), ("model.nope.weight", (2, 2), "bfloat16")]



def test_an_open_update_of_packed_parts_lands_in_every_rank_as_one_update(
    llm_tp2, checkpoints
) -> None:
    """vLLM's start / update / finish on the engine: two parts in vLLM's packed chunks
    (a small buffer: many chunks), nothing served between, every rank's shard loaded."""
    import concurrent.futures

    from peer_trainers import Communicator, packed_nccl_broadcast_producer

    pairs = checkpoint_tensors(str(checkpoints.path(4)), 0)
    port = free_port()
    # a name of its own: this process may hold a TP=1 engine's rank in another group
    sender = WeightBroadcaster("127.0.0.1", port, world_size=3, timeout_s=30,
                               group_name="open_update")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        connected = pool.submit(sender.connect)
        llm_tp2.init_weights_update_group("127.0.0.1", port, 1, 3, backend="gloo",
                                          group_name="open_update", timeout_s=30)
        connected.result()
        llm_tp2.start_weight_update()
        for part in (pairs[:5], pairs[5:]):
            sent = pool.submit(packed_nccl_broadcast_producer, iter(part),
                               Communicator(sender.group), 0, lambda item: item[1], 2048)
            assert llm_tp2.update_weights_from_distributed(
                *WeightBroadcaster.spec(part), packed_bytes=2048) == len(part)
            sent.result()
            with pytest.raises(SleepStateError, match="a weight update is open"):
                llm_tp2.generate(PROMPTS, GREEDY)
        llm_tp2.finish_weight_update()
    sender.close()
    llm_tp2.destroy_weights_update_group()
    assert [o.token_ids for o in llm_tp2.generate(PROMPTS, GREEDY)] == \
        checkpoints.expected(4, "float32")

