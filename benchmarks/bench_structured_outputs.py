"""What structured outputs (xgrammar, ``core/engine/step_grammars.py``) cost per token.

(a) **host cost per constrained token**: the two host calls the engine makes for each
constrained row of a step, through the engine's own ``GrammarCompiler``: xgrammar's
``fill_next_token_bitmask`` (the row's mask of allowed next tokens) and
``accept_token`` (the sampled token fed to the matcher), walking
:data:`SCHEMA`'s grammar with a uniformly drawn allowed token at each step (what a
random model does), restarting when a document is complete. At Qwen3's vocabulary:
151,669 tokens in a logits width of 151,936. No Qwen tokenizer is read (nothing is
downloaded): the vocabulary is a synthetic byte-level one of that size
(:func:`synthetic_tokenizer`: the 256 bytes, then English-like words with and without a
leading space, punctuation and whitespace runs, CJK pieces, ``<|endoftext|>`` at id 0).
The same walk over the tiny tokenizer's vocabulary (413 tokens, which
bench_e2e_decode's random checkpoints carry) in the same width is printed beside it:
xgrammar's work follows the tokenizer's tokens, so the tiny vocabulary understates it.
The floor: writing one row of the mask (``ceil(width / 32)`` int32 words), measured.
batch x (fill + accept) is the host time a constrained step would add with its rows
filled one after another, printed at the rollout's batch. The engine fills a step's
rows in one call of xgrammar's batch matcher (its own thread pool): the time of that
call for 256 requests at random places in the grammar is printed beside the same rows
filled one by one.

(b) **the rollout**: a random Qwen3-0.6B-shaped checkpoint (bench_e2e_decode's
weights, bf16) with the synthetic 151,669-token tokenizer, ``batch`` requests of
random prompts, seeded T = 1.0, ``ignore_eos`` off, each way from a cold prefix
cache: unconstrained with ``max_tokens`` (the bound), the same requests held to
:data:`SCHEMA` (a complete document ends its request early, with ``"stop"``; while any
constrained request runs the engine steps synchronously and samples eagerly after
the graph's replay), the unconstrained batch again with each request's
``max_tokens`` cut to its constrained output's length (the same tokens at the same
batch occupancy: the ratio to it is the constraint's cost alone), and the first way
again (drift). Tokens/s of each, the ratio to the bound and to the cut batch, and each
beside its HBM/FLOP floor (bench_rollout's: each decode step reads the weights and the
KV of the requests still running; the prefill's FLOPs at ~790 TFLOP/s).

``--small`` runs both parts on the CPU in seconds (the tiny model, a 4,096-token
synthetic vocabulary for (a); tests/benchmarks/test_bench_structured_outputs.py); its
figures say nothing about speed.

    python benchmarks/bench_structured_outputs.py [--small] [--batch 256] [--new 512]
        [--host-tokens 4000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from kvrunner import LLM, SamplingParams

#: an RL-shaped answer: free text, then a short answer
SCHEMA = json.dumps({
    "type": "object",
    "properties": {"reasoning": {"type": "string"}, "answer": {"type": "string"}},
    "required": ["reasoning", "answer"],
})
#: the smoke run's: short strings, so that its few tokens complete documents
SMALL_SCHEMA = json.dumps({
    "type": "object",
    "properties": {"reasoning": {"type": "string", "maxLength": 4},
                   "answer": {"type": "string", "maxLength": 2}},
    "required": ["reasoning", "answer"],
})
#: Qwen3's tokenizer (151,643 BPE tokens and 26 added) and its logits width
QWEN3_TOKENS, QWEN3_WIDTH = 151_669, 151_936
EOS = "<|endoftext|>"
BF16_TFLOPS = 790.0
#: the rows of the step whose mask fill (a) times
STEP_ROWS = 256


@attrs.frozen(kw_only=True)
class Shape:
    """One run's sizes."""

    batch: int
    prompt: int
    new: int
    #: (a): the synthetic vocabulary's tokens and the logits width
    tokens: int
    width: int
    host_tokens: int
    schema: str = SCHEMA
    #: xgrammar's whitespace between JSON's tokens off (vLLM's ``disable_any_whitespace``)
    compact: bool = False


GPU = Shape(batch=256, prompt=256, new=512, tokens=QWEN3_TOKENS, width=QWEN3_WIDTH,
            host_tokens=4000)
SMALL = Shape(batch=8, prompt=8, new=40, tokens=4096, width=4096 + 64, host_tokens=300,
              schema=SMALL_SCHEMA, compact=True)


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, map(chr, printable), strict=True)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def synthetic_tokenizer(size: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE tokenizer of ``size`` tokens (no merges: it decodes every id,
    which is all the engine and xgrammar read): ``<|endoftext|>`` at id 0, the 256
    bytes, then distinct pieces drawn as a large BPE vocabulary is made of (75%
    English-like words, most with a leading space; 10% runs of punctuation and
    whitespace; 15% one or two CJK characters)."""
    rng = random.Random(seed)
    chars = _byte_chars()
    vocab = {EOS: 0}
    for b in range(256):
        vocab.setdefault(chars[b], len(vocab))
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4, 2.4,
               2.2, 2.0, 2.0, 1.9, 1.5, 1.0, 0.8, 0.2, 0.2, 0.1, 0.1]
    punctuation = ' \n\t{}[]():;,."\'-_=+*/<>#@!?`|&%$\\'
    while len(vocab) < size:
        r = rng.random()
        if r < 0.75:
            word = "".join(rng.choices(letters, weights, k=rng.randint(2, 10)))
            word = word.capitalize() if rng.random() < 0.15 else word
            text = " " + word if rng.random() < 0.6 else word
        elif r < 0.85:
            text = "".join(rng.choice(punctuation) for _ in range(rng.randint(1, 4)))
        else:
            text = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 2)))
        vocab.setdefault("".join(chars[b] for b in text.encode()), len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOS, special=True)])
    return tokenizer


def tiny_tokenizer() -> tuple[Tokenizer, int]:
    """The tiny model's tokenizer (bench_e2e_decode's checkpoints carry it) and its EOS id."""
    from kvrunner.models.tiny import EOS_TOKEN, build_tokenizer

    tokenizer = build_tokenizer()
    return tokenizer, tokenizer.token_to_id(EOS_TOKEN)


def _allowed(bits: np.ndarray, width: int) -> np.ndarray:
    """The token ids a mask row allows (xgrammar's layout: bit j of word w is 32w + j)."""
    return np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:width])


def row_write_us(width: int, calls: int = 2000) -> float:
    """Median microseconds to write one mask row of ``width`` tokens: the fill's floor."""
    row = np.empty(-(-width // 32), np.int32)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        row.fill(-1)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def host_cost(name: str, tokenizer: Tokenizer, width: int, eos: int, tokens: int,
              constraint: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """(a) for one vocabulary: the engine's compiler and a matcher walked ``tokens``
    tokens through ``constraint`` (a ``StructuredOutputsParams``' fields; see the module
    docstring)."""
    import xgrammar as xgr

    from kvrunner.engine.grammar_compiler import GrammarCompiler
    from kvrunner.engine.token_masks import mask_width
    from kvrunner.structured_outputs import StructuredOutputsParams

    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, width, [eos])
    info_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = compiler.compile(StructuredOutputsParams(**constraint))
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(grammar)
    bits = np.empty((1, mask_width(width)), np.int32)
    rng = np.random.default_rng(seed)
    fills, accepts, documents, allowed_counts = [], [], 0, []
    for _ in range(tokens):
        t0 = time.perf_counter_ns()
        matcher.fill_next_token_bitmask(bits, 0)
        fills.append(time.perf_counter_ns() - t0)
        allowed = _allowed(bits[0], width)
        allowed_counts.append(len(allowed))
        token = int(rng.choice(allowed))
        t0 = time.perf_counter_ns()
        ok = matcher.accept_token(token)
        accepts.append(time.perf_counter_ns() - t0)
        if not ok:
            raise RuntimeError(f"{name}: the matcher refused token {token} its own mask allowed")
        if matcher.is_terminated():
            documents += 1
            matcher.reset()
    batch_ms, serial_ms = step_fill_ms(grammar, width, rng)
    return {"vocabulary": name, "tokens": tokenizer.get_vocab_size(), "width": width,
            "batch_fill_ms": batch_ms, "serial_fill_ms": serial_ms,
            "info_s": info_s, "compile_s": compile_s, "walked": tokens, "documents": documents,
            "fill_us": statistics.median(fills) / 1e3, "fill_mean_us": statistics.mean(fills) / 1e3,
            "fill_p99_us": float(np.percentile(fills, 99)) / 1e3,
            "accept_us": statistics.median(accepts) / 1e3,
            "accept_mean_us": statistics.mean(accepts) / 1e3,
            "allowed_median": int(statistics.median(allowed_counts)),
            "floor_us": row_write_us(width)}


def step_fill_ms(grammar: Any, width: int, rng: np.random.Generator, rows: int = STEP_ROWS,
                 repeats: int = 5) -> tuple[float, float]:
    """Milliseconds to fill one step's masks for ``rows`` requests, each walked a random
    number of tokens into ``grammar``: as the engine fills them (xgrammar's batch
    matcher, its thread pool), and one row after another (median of ``repeats``)."""
    import xgrammar as xgr

    from kvrunner.engine.token_masks import mask_width

    bits = np.empty((1, mask_width(width)), np.int32)
    matchers = []
    for _ in range(rows):
        matcher = xgr.GrammarMatcher(grammar)
        for _ in range(int(rng.integers(0, 24))):
            matcher.fill_next_token_bitmask(bits, 0)
            token = int(rng.choice(_allowed(bits[0], width)))
            if not matcher.accept_token(token) or matcher.is_terminated():
                break
        matchers.append(matcher)
    step = np.empty((rows, mask_width(width)), np.int32)
    batch = xgr.BatchGrammarMatcher()
    batched, serial = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, step)
        batched.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for k, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(step, k)
        serial.append(time.perf_counter() - t0)
    return statistics.median(batched) * 1e3, statistics.median(serial) * 1e3


def print_host(rows: list[dict[str, Any]], batch: int, schema: str, compact: bool) -> None:
    print(f"(a) host cost per constrained token, schema {schema}, any whitespace "
          f"{'off' if compact else 'on'}")
    print(f"{'vocabulary':>24} {'tokens':>8} {'width':>8} {'info s':>7} {'compile s':>9} "
          f"{'fill us p50':>11} {'mean':>7} {'p99':>7} {'accept us':>9} {'mean':>6} "
          f"{'allowed':>8} {'docs':>5} {'floor us':>8} {'x floor':>7} {f'step ms @{batch}':>12} "
          f"{f'fill ms @{STEP_ROWS}':>12} {'one by one':>10}")
    for r in rows:
        per_token = r["fill_mean_us"] + r["accept_mean_us"]
        print(f"{r['vocabulary']:>24} {r['tokens']:>8} {r['width']:>8} {r['info_s']:>7.2f} "
              f"{r['compile_s']:>9.3f} {r['fill_us']:>11.1f} {r['fill_mean_us']:>7.1f} "
              f"{r['fill_p99_us']:>7.1f} {r['accept_us']:>9.1f} {r['accept_mean_us']:>6.1f} "
              f"{r['allowed_median']:>8} {r['documents']:>5} {r['floor_us']:>8.2f} "
              f"{r['fill_mean_us'] / r['floor_us']:>7.1f} {batch * per_token / 1e3:>12.2f} "
              f"{r['batch_fill_ms']:>12.2f} {r['serial_fill_ms']:>10.2f}")
    print("step ms: batch x (mean fill + mean accept), the host time a step of that many "
          "constrained rows adds, filled one by one; allowed: median tokens a mask allows; "
          "docs: documents the walk completed")
    print(f"fill ms @{STEP_ROWS}: one step's masks for {STEP_ROWS} requests at random "
          f"places in the grammar, filled as the engine fills them (xgrammar's batch "
          f"matcher, {os.cpu_count()} CPUs here); one by one: the same rows, a call each")


@attrs.define
class Row:
    way: str
    tokens: int
    seconds: float
    lengths: list[int]
    finish: dict[str, int]
    floor_s: float


def rollout_floor(weight_bytes: int, prompt: int, lengths: list[int]) -> float:
    """bench_rollout's floor for requests of the given output lengths: decode step i
    reads the weights and the KV of the requests still running; the prefill does
    2 x parameters x tokens FLOPs at ~790 TFLOP/s."""
    from bench_e2e_decode import KV_PER_TOKEN
    from common import copy_bandwidth_tbps

    bw = copy_bandwidth_tbps() * 1e12
    ends = np.sort(np.asarray(lengths))
    decode = 0.0
    for i in range(int(ends[-1])):
        live = len(ends) - np.searchsorted(ends, i, side="right")
        decode += (weight_bytes + live * (prompt + i) * KV_PER_TOKEN) / bw
    prefill = 2 * weight_bytes / 2 * len(lengths) * prompt / (BF16_TFLOPS * 1e12)
    return decode + prefill


def run(llm: LLM, way: str, prompts: list[list[int]], params: list[SamplingParams],
        floor: Any) -> tuple[Row, list[Any]]:
    llm.reset_prefix_cache()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    seconds = time.perf_counter() - start
    lengths = [len(o.token_ids) for o in outs]
    finish: dict[str, int] = {}
    for o in outs:
        finish[o.finish_reason] = finish.get(o.finish_reason, 0) + 1
    return Row(way, sum(lengths), seconds, lengths, finish, floor(lengths)), outs


def print_rollout(rows: list[Row], shape: Shape, documents: tuple[int, int]) -> None:
    base, cut = rows[0].tokens / rows[0].seconds, rows[2].tokens / rows[2].seconds
    print(f"\n(b) rollout: batch {shape.batch}, prompts of {shape.prompt}, max_tokens "
          f"{shape.new}, seeded T=1.0, ignore_eos off")
    print(f"{'way':>40} {'tokens':>8} {'mean len':>8} {'s':>8} {'tok/s':>9} {'vs bound':>9} "
          f"{'vs cut':>7} {'floor s':>8} {'s/floor':>8}  finish")
    for r in rows:
        tps = r.tokens / r.seconds
        print(f"{r.way:>40} {r.tokens:>8} {r.tokens / len(r.lengths):>8.1f} {r.seconds:>8.3f} "
              f"{tps:>9.0f} {tps / base:>9.3f} {tps / cut:>7.3f} {r.floor_s:>8.3f} "
              f"{r.seconds / r.floor_s:>8.2f}  {r.finish}")
    complete, parsed = documents
    print(f"constrained requests that ended their document: {complete}, of which parse as "
          f"the schema's JSON: {parsed}")


def build(small: bool, shape: Shape) -> tuple[LLM, int, Any]:
    """The engine, the size of its tokenizer (prompts draw below it) and the floor of a
    set of output lengths (NaN on the CPU)."""
    if small:
        from kvrunner.models.tiny import write_tiny_checkpoint

        path = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", kind="qwen3", seed=0)
        llm = LLM(str(path), max_num_seqs=shape.batch, max_model_len=64,
                  max_num_batched_tokens=256, capture_sizes=(1, 2, 4, 8))
        return llm, tiny_tokenizer()[0].get_vocab_size(), lambda lengths: float("nan")
    from bench_e2e_decode import write_checkpoint

    path = Path(tempfile.mkdtemp()) / "qwen3-0.6b-random"
    weight_bytes = write_checkpoint(path)
    tokenizer = synthetic_tokenizer(shape.tokens)
    (path / "tokenizer.json").write_text(tokenizer.to_str())
    llm = LLM(model=str(path), dtype="bfloat16", max_num_seqs=shape.batch,
              max_model_len=shape.prompt + shape.new + 16, max_num_batched_tokens=16384,
              gpu_memory_utilization=0.7)
    return llm, shape.tokens, lambda lengths: rollout_floor(weight_bytes, shape.prompt, lengths)


def schema_documents(outs: list[Any]) -> tuple[int, int]:
    """How many constrained outputs ended their document (``"stop"``), and how many of
    those parse as JSON holding the schema's two strings (control characters inside a
    string allowed)."""
    complete = [o for o in outs if o.finish_reason == "stop"]
    parsed = 0
    for o in complete:
        try:
            # not strict: xgrammar's rule for a length-bounded string lets raw control
            # characters through, which strict JSON refuses
            doc = json.loads(o.text, strict=False)
        except ValueError:
            continue
        parsed += isinstance(doc, dict) and all(isinstance(doc.get(k), str)
                                                for k in ("reasoning", "answer"))
    return len(complete), parsed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true",
                    help="the CPU smoke run: the tiny model, a small vocabulary, seconds")
    ap.add_argument("--batch", type=int, default=None, help="requests in the rollout")
    ap.add_argument("--new", type=int, default=None, help="max_tokens of each request")
    ap.add_argument("--host-tokens", type=int, default=None,
                    help="tokens each (a) walk fills masks for and accepts")
    args = ap.parse_args(argv)
    shape = SMALL if args.small else GPU
    for field in ("batch", "new", "host_tokens"):
        if getattr(args, field) is not None:
            if getattr(args, field) < 1:
                ap.error(f"--{field.replace('_', '-')} must be at least 1")
            shape = attrs.evolve(shape, **{field: getattr(args, field)})

    constraint = {"json": shape.schema, "disable_any_whitespace": shape.compact}
    tiny, tiny_eos = tiny_tokenizer()
    host = [host_cost(f"synthetic, {shape.tokens:,}", synthetic_tokenizer(shape.tokens),
                      shape.width, 0, shape.host_tokens, constraint),
            host_cost(f"tiny, {tiny.get_vocab_size()}", tiny, shape.width, tiny_eos,
                      shape.host_tokens, constraint)]
    print_host(host, shape.batch, shape.schema, shape.compact)

    llm, vocab, floor = build(args.small, shape)
    try:
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(1, vocab, (shape.batch, shape.prompt), generator=g).tolist()
        plain = [SamplingParams(max_tokens=shape.new, temperature=1.0, seed=i)
                 for i in range(shape.batch)]
        constrained = [attrs.evolve(p, structured_outputs=constraint) for p in plain]
        # warm up: the batch's prefill and decode shapes, xgrammar's import and the
        # schema's compile (cached by its text), a few tokens each
        llm.generate(prompts, [attrs.evolve(p, max_tokens=4) for p in plain])
        llm.generate(prompts, [attrs.evolve(p, max_tokens=4) for p in constrained])
        bound, _ = run(llm, "unconstrained (the bound)", prompts, plain, floor)
        held, outs = run(llm, "JSON schema", prompts, constrained, floor)
        cut_params = [attrs.evolve(p, max_tokens=max(1, n))
                      for p, n in zip(plain, held.lengths, strict=True)]
        cut, _ = run(llm, "unconstrained, cut to the schema's lengths", prompts, cut_params,
                     floor)
        again, _ = run(llm, "unconstrained, again", prompts, plain, floor)
    finally:
        llm.shutdown()
    rows = [bound, held, cut, again]
    documents = schema_documents(outs)
    print_rollout(rows, shape, documents)
    if args.small:
        print("(--small: the tiny model's own tokenizer in (b), a 4,096-token synthetic "
              "vocabulary in (a), a schema of short strings without whitespace; no figure "
              "here says anything about speed)")
    else:
        print(f"(b) runs on the synthetic {shape.tokens:,}-token vocabulary: a random "
              f"checkpoint's bench_e2e_decode tokenizer has {tiny.get_vocab_size()} tokens")
    return {"host": host, "rows": rows, "documents": documents, "outputs": outs,
            "shape": shape}


if __name__ == "__main__":
    main()
