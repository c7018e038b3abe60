"""The Python heap of a process kvrunner owns, frozen once its engine is up.

CPython's oldest-generation collections walk every tracked object. A serving process
holds a few hundred thousand from its start (torch, the model's modules, the captured
graphs, the web stack), and a rollout's churn of requests, outputs and JSON bodies
sets off such collections, each walking them all: a pause of about 100 ms on a 2-core
host, during which the step loop stalls and the device runs dry. Frozen
(``gc.freeze``), that start-up heap is left out of every collection (vLLM freezes
the processes it owns the same way); objects made later are collected as before.

A frozen object is never collected, even once it is garbage. The engine's releases
that wait on the collector to break reference cycles (a sleep's pool release, an
engine dropped without shutdown) call :func:`collect`, which thaws the heap, collects
everything, and freezes what is left.

Only processes kvrunner owns freeze: ``kvrunner serve`` (:func:`freeze_started_heap`
before it listens), a rank's worker process (before it takes commands) and a Ray
replica's actor (once its engine is built). A user's process that builds an ``LLM``
keeps its collector as the user set it.
"""

from __future__ import annotations

import gc


def freeze_started_heap() -> int:
    """Collect, then freeze every object alive: the process has started its engine.
    Returns how many objects are frozen."""
    gc.collect()  # garbage frozen now could never be collected
    gc.freeze()
    return gc.get_freeze_count()


def collect() -> None:
    """A full collection that reaches frozen objects too: thaw, collect, and freeze
    again what survives (a heap that was not frozen is collected and left unfrozen)."""
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
