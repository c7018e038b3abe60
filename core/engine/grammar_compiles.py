"""The grammars being compiled, off the engine's thread, for the requests that wait on them.

Compiling a constraint against the vocabulary (``engine/grammar_compiler.py``) takes
from a millisecond to seconds (a JSON schema of a few hundred properties, a vocabulary
of 150k tokens). Done where the request is made, it would hold up every other
request's steps for that long, so it runs on a small pool of threads instead, as
vLLM's structured-output manager does: a constrained request waits here, outside the
scheduler, until its grammar is ready, while the engine steps the others. xgrammar
releases the GIL while it compiles, so the engine's thread runs on meanwhile.

:meth:`GrammarCompiles.start` submits a request's compile (the parse of its schema,
pattern or grammar included: that too grows with the schema); the engine calls
:meth:`GrammarCompiles.done` at the start of every step and queues each request whose
grammar is ready, or ends it with ``"error"`` when its constraint could not be parsed
or compiled. A request aborted while it waits is dropped from here; its compile runs
on and its result is discarded. The samples of one request share one compile.

The first compile also builds the vocabulary's ``xgrammar.TokenizerInfo`` (a pass over
every token), on the pool as well.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from kvrunner.engine.grammar_compiler import GrammarCompiler
from kvrunner.engine.sequence import Sequence
from kvrunner.structured_outputs import StructuredOutputsParams

#: how many threads compile at once: half the host's cores (compiles are CPU-bound, and
#: xgrammar spreads one compile over threads of its own), at least one
POOL_THREADS = max(1, ((os.cpu_count() or 1) + 1) // 2)


class GrammarCompiles:
    """The compiles in progress and the requests waiting on them (see the module
    docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        """:param tokenizer: the engine's ``tokenizers.Tokenizer``.
        :param vocab_size: the width of the model's logits.
        :param eos_token_ids: the model's EOS ids: a complete grammar's stop tokens."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = tuple(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        #: the waiting requests by id, with their names and compiles, in the order they came
        self._waiting: dict[int, tuple[Sequence, str, Future]] = {}
        #: the compiles not yet collected, by constraint: samples of a request share one
        self._by_params: dict[StructuredOutputsParams, Future] = {}

    def __len__(self) -> int:
        """How many requests wait for their grammar."""
        return len(self._waiting)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._waiting

    def start(self, seq: Sequence, name: str) -> None:
        """Compile ``seq``'s constraint on the pool; ``seq`` waits here meanwhile.

        :param name: how an error names the request (``"request 3"``)."""
        params = seq.sampling_params.structured_outputs
        assert params is not None
        future = self._by_params.get(params)
        if future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(POOL_THREADS,
                                                thread_name_prefix="kvrunner-grammar")
            future = self._pool.submit(self._compile, params)
            self._by_params[params] = future
        self._waiting[seq.seq_id] = (seq, name, future)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        """On a pool thread: ``params`` compiled (an ``xgrammar.CompiledGrammar``)."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._eos)
        return self._compiler.compile(params)

    def done(self) -> list[tuple[Sequence, Any, str | None]]:
        """Take the waiting requests whose compile ended, in the order they came: each
        with its compiled grammar, or None and why the compile failed, naming the
        request (``"request 3: SamplingParams.structured_outputs.json could not be
        parsed: ..."``)."""
        out = []
        for seq_id, (seq, name, future) in list(self._waiting.items()):
            if not future.done():
                continue
            del self._waiting[seq_id]
            error = future.exception()
            if error is None:
                out.append((seq, future.result(), None))
            else:
                out.append((seq, None, f"{name}: {str(error) or type(error).__name__}"))
        if out:
            self._by_params = {p: f for p, f in self._by_params.items() if not f.done()}
        return out

    def wait(self, timeout: float) -> None:
        """Block until a waiting request's compile ends, or ``timeout`` seconds pass."""
        futures = {future for _, _, future in self._waiting.values()}
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def drop(self, seq_id: int) -> Sequence | None:
        """Stop waiting for request ``seq_id``'s grammar (it was aborted); the request,
        or None if it was not waiting. Its compile's result is discarded."""
        entry = self._waiting.pop(seq_id, None)
        return None if entry is None else entry[0]

    def drop_all(self) -> list[Sequence]:
        """Stop waiting for every grammar; the requests that waited."""
        seqs = [seq for seq, _, _ in self._waiting.values()]
        self._waiting.clear()
        return seqs
