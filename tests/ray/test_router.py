"""How the fleet picks a replica: an id sticks to the replica it was last served on,
a new one goes to the least loaded live replica, and no request goes to a dead one."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrunner.ray.errors import NoReplicaError
from kvrunner.ray.router import ReplicaRouter


def test_an_idle_fleet_is_filled_round_robin() -> None:
    router = ReplicaRouter(3)
    picks = [router.pick(f"r{i}") for i in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]


def test_a_request_id_goes_back_to_its_replica_even_when_another_is_less_loaded() -> None:
    router = ReplicaRouter(2)
    first = router.pick("traj")
    router.finished(first)
    for i in range(3):
        router.pick(f"busy{i}")  # loads the fleet unevenly
    assert router.pick("traj") == first


def test_an_id_whose_replica_died_moves_to_a_live_one() -> None:
    router = ReplicaRouter(2)
    first = router.pick("traj")
    router.finished(first)
    router.mark_dead(first)
    assert router.pick("traj") == 1 - first
    router.mark_dead(1 - first)
    with pytest.raises(NoReplicaError, match="every replica"):
        router.pick("traj")


def test_the_sticky_map_forgets_the_least_recently_used_ids_first() -> None:
    router = ReplicaRouter(2, sticky_capacity=2)
    router.pick("a")
    router.pick("b")
    router.pick("a")  # a is now the more recent
    router.pick("c")
    assert router.replica_of("b") is None
    assert router.replica_of("a") is not None and router.replica_of("c") is not None


events = st.lists(
    st.one_of(
        st.tuples(st.just("pick"), st.integers(0, 7)),
        st.tuples(st.just("finish"), st.integers(0, 50)),
        st.tuples(st.just("kill"), st.integers(0, 3)),
    ),
    max_size=60,
)


@given(events)
def test_routing_never_picks_a_dead_replica_and_new_ids_go_to_the_least_loaded(ops) -> None:
    router = ReplicaRouter(4)
    open_requests: list[int] = []
    for op, arg in ops:
        if op == "kill":
            if len(router.live) > 1:
                router.mark_dead(arg)
        elif op == "finish":
            if open_requests:
                router.finished(open_requests.pop(arg % len(open_requests)))
        else:
            rid = f"id{arg}"
            known = router.replica_of(rid)
            load = list(router.in_flight)
            replica = router.pick(rid)
            open_requests.append(replica)
            assert router.alive[replica]
            if known is not None and router.alive[known]:
                assert replica == known
            else:
                assert load[replica] == min(load[i] for i in router.live)
    assert sum(router.in_flight) == len(open_requests)
