"""benchmarks/bench_structured_outputs.py runs end to end on the CPU (``--small``): the
host walk fills and accepts every token it is asked for at each vocabulary and
completes documents; in the rollout every way generates, the constrained batch ends its
documents as the schema's JSON and never leaves its grammar, and the batch cut to the
constrained lengths generates exactly those lengths."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import xgrammar as xgr
from tokenizers import Tokenizer

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_small_structured_outputs_benchmark_measures_both_parts(capsys) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_structured_outputs as bench

        got = bench.main(["--small"])
    finally:
        sys.path.remove(str(BENCHMARKS))
    shape = got["shape"]
    synthetic, tiny = got["host"]
    assert (synthetic["tokens"], synthetic["width"]) == (shape.tokens, shape.width)
    assert tiny["tokens"] == 413 and tiny["width"] == shape.width
    for walk in got["host"]:
        assert walk["walked"] == shape.host_tokens and walk["documents"] > 0, walk
        assert walk["fill_us"] > 0 and walk["accept_us"] > 0 and walk["floor_us"] > 0, walk

    bound, held, cut, again = got["rows"]
    assert [r.way for r in got["rows"]] == [
        "unconstrained (the bound)", "JSON schema", "unconstrained, cut to the schema's lengths",
        "unconstrained, again"]
    assert all(0 < n <= shape.new for n in held.lengths)
    # the cut batch asks for each constrained length; a random model's EOS may end earlier
    assert all(c <= h for c, h in zip(cut.lengths, held.lengths, strict=True))
    assert bound.tokens > 0 and again.tokens > 0
    # every constrained output stays inside the grammar, and an ended one is a document
    assert set(held.finish) <= {"stop", "length"}, held.finish
    complete, parsed = got["documents"]
    assert complete == held.finish.get("stop", 0) and complete > 0 and parsed == complete
    outs = got["outputs"]
    for out in outs:
        if out.finish_reason == "stop":
            doc = json.loads(out.text, strict=False)
            assert set(doc) == {"reasoning", "answer"} and len(doc["answer"]) <= 2, out.text
    text = capsys.readouterr().out
    assert "fill us p50" in text and "vs cut" in text and "floor s" in text


def test_the_synthetic_vocabulary_has_the_size_asked_and_decodes_every_id() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_structured_outputs as bench

        tokenizer: Tokenizer = bench.synthetic_tokenizer(2048)
    finally:
        sys.path.remove(str(BENCHMARKS))
    vocab = tokenizer.get_vocab()
    assert len(vocab) == tokenizer.get_vocab_size() == 2048
    assert sorted(vocab.values()) == list(range(2048)) and vocab[bench.EOS] == 0
    assert tokenizer.decode(list(range(1, 257))).encode() != b""  # every byte decodes
    info = xgr.TokenizerInfo.from_huggingface(
        __import__("transformers").PreTrainedTokenizerFast(tokenizer_object=tokenizer),
        vocab_size=2048 + 64, stop_token_ids=[0])
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
