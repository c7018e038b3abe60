"""A refused weight update leaves the old weights serving.

An update whose contents are known up front (a list or Mapping given to
``update_weights``, a checkpoint directory given to ``load_weights``) is judged
whole, names, shapes, dtypes and values, before its first tensor loads: after
any refusal the engine is not ``partial`` and serves the same greedy tokens as
before, at the same weight version. A streamed push (a generator, IPC buckets, a
weight-update group) judges each part whole before that part loads; a refusal
after earlier parts loaded leaves the weights ``partial`` and says which calls
serve again (tests/core/test_weight_faults.py, tests/weight_sync/).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_weight_faults import GREEDY, PROMPTS, SETTINGS, VICTIM, tokens

from kvrunner import LLM, CheckpointError
from kvrunner.async_llm import AsyncLLM
from kvrunner.errors import WeightUpdateError
from kvrunner.models.loader import iter_safetensors
from kvrunner.models.tiny import write_tiny_checkpoint

EXTRA = "model.layers.0.mlp.extra.weight"

Tensors = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("transactions")
    return write_tiny_checkpoint(root / "a", seed=0), write_tiny_checkpoint(root / "b", seed=1)


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    """One engine serving checkpoint a: every refusal below must leave it so."""
    engine = LLM(model=str(checkpoints[0]), **SETTINGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def served(llm) -> list[list[int]]:
    return tokens(llm)


def last_name(tensors: Tensors) -> str:
    """The tensor a checkpoint or a push holds last (loaded after all the others)."""
    return list(tensors)[-1]


def wrong_shape(t: Tensors) -> None:
    t[VICTIM] = t[VICTIM][:, :-1].contiguous()


def missing(t: Tensors) -> None:
    del t[VICTIM]


def extra(t: Tensors) -> None:
    t[EXTRA] = torch.zeros(2, 2)


def integer(t: Tensors) -> None:
    t[VICTIM] = t[VICTIM].to(torch.int32)


def nan_last(t: Tensors) -> None:
    name = last_name(t)
    t[name] = t[name].clone()
    t[name].view(-1)[-1] = float("nan")


#: fault -> (edit of the pushed tensors, the name the refusal names, what it says)
CHECKPOINT_FAULTS: dict[str, tuple[Callable[[Tensors], None], str | None, str]] = {
    "wrong shape": (wrong_shape, VICTIM, "shape"),
    "missing name": (missing, VICTIM, "missing"),
    "extra name": (extra, EXTRA, "unexpected"),
    "integer dtype": (integer, VICTIM, "I32; weights must be floating point"),
    "NaN in the last tensor": (nan_last, None, "NaN or inf"),
}


def pushed_tensors(checkpoint: Path) -> Tensors:
    return dict(iter_safetensors(checkpoint, torch.float32))


@pytest.mark.parametrize("fault", sorted(CHECKPOINT_FAULTS))
def test_a_refused_checkpoint_leaves_the_old_weights_serving(
    llm, served, checkpoints, tmp_path, fault
) -> None:
    change, name, why = CHECKPOINT_FAULTS[fault]
    bad = tmp_path / "bad"
    shutil.copytree(checkpoints[1], bad)
    tensors = load_file(bad / "model.safetensors")
    change(tensors)
    save_file(tensors, bad / "model.safetensors")
    name = name or last_name(load_file(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")) as refused:
        llm.load_weights(bad)
    assert why in str(refused.value)
    assert llm.cache_info().weights == "resident"
    assert tokens(llm) == served


def _last(pairs: list, name: str, value: object) -> list:
    """``pairs`` with ``name``'s value replaced and moved last (loaded after the rest)."""
    return [(n, t) for n, t in pairs if n != name] + [(name, value)]


def _victim(pairs: list) -> torch.Tensor:
    return dict(pairs)[VICTIM]


#: fault -> (edit of the list of pairs, the name the refusal names, what it says)
PUSH_FAULTS = {
    "wrong shape": (lambda p: _last(p, VICTIM, _victim(p)[:, :-1]), VICTIM, "expected"),
    "extra name": (lambda p: [*p, (EXTRA, torch.zeros(2, 2))], EXTRA, "has no parameter"),
    "duplicate name": (lambda p: [*p, p[0]], None, "given twice"),
    "integer dtype": (lambda p: _last(p, VICTIM, _victim(p).long()), VICTIM, "int64"),
    "NaN in the last tensor": (
        lambda p: [*p[:-1], (p[-1][0], p[-1][1].clone().fill_(float("nan")))], None,
        "NaN or inf"),
    "meta tensor": (lambda p: _last(p, VICTIM, torch.empty(4, 4, device="meta")), VICTIM,
                    "meta device"),
    "non-str name": (lambda p: [*p, (123, p[0][1])], "item", "must be a str"),
}


#: a dict holds each key once, and its keys are the names
LIST_ONLY = ("duplicate name", "non-str name")


@pytest.mark.parametrize(("container", "fault"), [
    (container, fault) for container in ("list", "mapping") for fault in sorted(PUSH_FAULTS)
    if container == "list" or fault not in LIST_ONLY])
def test_a_refused_push_known_up_front_leaves_the_old_weights_serving(
    llm, served, checkpoints, fault, container
) -> None:
    change, name, why = PUSH_FAULTS[fault]
    pairs = change(list(pushed_tensors(checkpoints[1]).items()))
    if container == "mapping":
        pairs = dict(pairs)
    name = name or (pairs[-1][0] if isinstance(pairs, list) else list(pairs)[-1])
    with pytest.raises(WeightUpdateError, match=name.replace(".", r"\.")) as refused:
        llm.update_weights(pairs)
    assert why in str(refused.value)
    assert llm.cache_info().weights == "resident"
    assert tokens(llm) == served


def test_a_name_given_twice_through_a_stacked_alias_is_refused(tmp_path) -> None:
    """A mixture-of-experts layer's experts pushed both stacked (transformers 5's
    ``experts.gate_up_proj``) and one by one in one update is a name given twice."""
    path = write_tiny_checkpoint(tmp_path / "moe", kind="qwen3-moe", seed=0)
    with LLM(model=str(path), **SETTINGS) as moe:
        before = tokens(moe)
        tensors = pushed_tensors(path)
        prefix = "model.layers.0.mlp.experts"
        ids = sorted({int(n.split(".")[5]) for n in tensors if n.startswith(prefix + ".")})
        gate_up = torch.stack([torch.cat([tensors[f"{prefix}.{e}.gate_proj.weight"],
                                          tensors[f"{prefix}.{e}.up_proj.weight"]])
                               for e in ids])
        with pytest.raises(WeightUpdateError, match="given twice"):
            moe.update_weights([*tensors.items(), (f"{prefix}.gate_up_proj", gate_up * 2)])
        assert moe.cache_info().weights == "resident"
        assert tokens(moe) == before


def test_a_good_push_after_the_refusals_loads(checkpoints) -> None:
    """The check that refuses is not a check that refuses everything."""
    with LLM(model=str(checkpoints[0]), **SETTINGS) as fresh, \
            LLM(model=str(checkpoints[1]), **SETTINGS) as reference:
        fresh.update_weights(list(pushed_tensors(checkpoints[1]).items()))
        assert tokens(fresh) == tokens(reference)
        fresh.load_weights(checkpoints[0])
        with LLM(model=str(checkpoints[0]), **SETTINGS) as again:
            assert tokens(fresh) == tokens(again)


def test_a_refused_update_keeps_the_served_weight_version(checkpoints, tmp_path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(checkpoints[1], bad)
    tensors = load_file(bad / "model.safetensors")
    nan_last(tensors)
    save_file(tensors, bad / "model.safetensors")

    async def run() -> None:
        engine = AsyncLLM(model=str(checkpoints[0]), **SETTINGS)
        try:
            await engine.load_weights(checkpoints[0], weight_version="v1")
            before = [o.token_ids for o in await asyncio.gather(
                *(engine.generate(p, GREEDY) for p in PROMPTS))]
            with pytest.raises(CheckpointError, match="NaN"):
                await engine.load_weights(bad, weight_version="v2")
            pairs = [(n, t.clone().fill_(float("nan"))) for n, t in
                     pushed_tensors(checkpoints[1]).items()]
            with pytest.raises(WeightUpdateError, match="NaN"):
                await engine.update_weights(pairs, weight_version="v3")
            assert engine.weight_version == "v1"
            after = await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))
            assert [o.token_ids for o in after] == before
            assert all(o.weight_version == "v1" for o in after)
        finally:
            await engine.shutdown()

    asyncio.run(run())
