"""A snapshot of the engine loop's counters, published after every step and command.

The engine thread replaces the whole (frozen) record; a reader on another thread
(``/metrics``) takes whichever record is current, never a half-written one, and
never waits for the loop.
"""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class EngineStats:
    """The engine loop's state as of its last step or command."""

    #: requests scheduled (running or parked under ``pause("keep")``)
    num_running: int = 0
    #: requests queued in the engine, plus those submitted while paused (held)
    num_waiting: int = 0
    #: KV blocks held by requests (free blocks that still cache a prefix count as free)
    blocks_used: int = 0
    blocks_total: int = 0
    #: recurrent-state slots in use / in all (0 / 0 for a model without them)
    state_slots_used: int = 0
    state_slots_total: int = 0
    #: output tokens generated since start (aborted requests' included)
    generated_tokens_total: int = 0
    #: prompt tokens of every request handed to the engine since start
    prompt_tokens_total: int = 0
    #: engine steps run since start
    num_steps: int = 0
    #: seconds the last engine step took (host and device, as the loop saw it)
    last_step_s: float = 0.0
    #: "awake", or the released parts (``"asleep: weights, kv_cache"``)
    sleep_state: str = "awake"
    #: the label of the weights being served
    weight_version: str | int = 0
    #: sampled rows whose logits were non-finite, since start
    nonfinite_rows: int = 0
    #: requests that ended with finish reason "abort", since start
    num_aborted: int = 0
    paused: bool = False
    #: the mode of the pause in force ("abort", "keep", "wait"), None when running
    pause_mode: str | None = None
