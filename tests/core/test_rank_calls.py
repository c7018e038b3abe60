"""The calls to ranks are typed: one client method per rank call, a typed answer each;
and the runner, the LLM and a rank's worker are assembled from parts, not mixins."""

from __future__ import annotations

import typing

import pytest

from kvrunner import LLM
from kvrunner.runner.model_runner import ModelRunner
from kvrunner.runner.ranks.rank_calls import CALLS, RankCalls, call_name
from kvrunner.runner.ranks.rank_client import RankClient
from kvrunner.runner.ranks.worker import RankWorker


def test_the_rank_client_has_one_typed_method_for_every_rank_call() -> None:
    client = {name for name, value in vars(RankClient).items()
              if callable(value) and not name.startswith("_")}
    assert client == set(CALLS)
    for name in CALLS:
        hints = typing.get_type_hints(getattr(RankClient, name))
        assert "return" in hints, f"RankClient.{name} has no typed answer"
        assert "Any" not in str(hints["return"]) or name == "describe", name


def test_a_call_is_named_by_its_method_and_nothing_else_reaches_a_rank() -> None:
    assert call_name(RankCalls.sleep) == "sleep"
    with pytest.raises(ValueError, match="not one of the rank calls"):
        call_name(print)
    with pytest.raises(ValueError, match="not one of the rank calls"):
        call_name(RankClient.sleep)  # the driver's side, not a rank's call


@pytest.mark.parametrize("cls", [ModelRunner, LLM, RankWorker, RankCalls, RankClient])
def test_the_runner_the_llm_and_the_worker_inherit_nothing(cls: type) -> None:
    assert cls.__bases__ == (object,)
