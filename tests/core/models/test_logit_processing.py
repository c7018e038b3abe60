"""vLLM's logit adjustments against a plain-torch reference written from vLLM's rules:
random logits, prompts, outputs (part started from the host, part recorded on the
device as a step would) and parameters."""

from __future__ import annotations

import attrs
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrunner.engine.logit_rules import logit_rules
from kvrunner.engine.step_io import SamplingColumns
from kvrunner.layers.logit_processing import adjusted_logits, mask_min_p_
from kvrunner.layers.sampler import sample
from kvrunner.layers.token_history import TokenHistory
from kvrunner.sampling_params import SamplingParams

VOCAB = st.integers(4, 16)


def reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
              output: list[int], bad_words: list[tuple[int, ...]], stops: list[int]
              ) -> torch.Tensor:  # fmt: skip
    """One row as vLLM's sampler adjusts it, token by token, or SGLang's where
    ``penalty_rules="sglang"``: frequency and presence first, the repetition penalty
    over the output alone, the bias last."""
    if params.penalty_rules == "sglang":
        return _sglang_reference(logits, params, prompt, output, bad_words, stops)
    x = logits.clone().float()
    if params.allowed_token_ids is not None:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[list(params.allowed_token_ids)] = True
        x[~keep] = float("-inf")
    for word in bad_words:
        prefix = list(word[:-1])
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            x[word[-1]] = float("-inf")
    if len(output) < params.min_tokens:
        x[stops] = float("-inf")
    for token, bias in params.logit_bias:
        x[token] += bias
    rep = torch.tensor(params.repetition_penalty, dtype=torch.float32)
    for t in range(len(x)):
        if t in prompt or t in output:
            x[t] = x[t] * (1 / rep) if x[t] > 0 else x[t] * rep
        x[t] -= params.frequency_penalty * output.count(t)
        x[t] -= params.presence_penalty * (t in output)
    return x


def _sglang_reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
                      output: list[int], bad_words: list[tuple[int, ...]], stops: list[int]
                      ) -> torch.Tensor:  # fmt: skip
    without_bias = attrs.evolve(params, logit_bias=None, repetition_penalty=1.0,
                                frequency_penalty=0.0, presence_penalty=0.0,
                                penalty_rules="vllm")
    x = reference(logits, without_bias, prompt, output, bad_words, stops)
    rep = torch.tensor(params.repetition_penalty, dtype=torch.float32)
    for t in range(len(x)):
        x[t] -= params.frequency_penalty * output.count(t)
        x[t] -= params.presence_penalty * (t in output)
        if t in output:
            x[t] = x[t] * (1 / rep) if x[t] > 0 else x[t] * rep
    for token, bias in params.logit_bias:
        x[token] += bias
    return x


@st.composite
def rows(draw):
    vocab = draw(VOCAB)
    n = draw(st.integers(1, 4))
    token = st.integers(0, vocab - 1)
    cases = []
    for h in range(n):
        allowed = draw(st.none() | st.lists(token, min_size=1, max_size=vocab))
        params = SamplingParams(
            max_tokens=64,
            repetition_penalty=draw(st.sampled_from([1.0, 0.5, 1.3, 2.0])),
            penalty_rules=draw(st.sampled_from(["vllm", "sglang"])),
            presence_penalty=draw(st.sampled_from([0.0, -0.7, 1.5])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.4, -1.1])),
            min_tokens=draw(st.integers(0, 4)),
            logit_bias={t: draw(st.floats(-100, 100)) for t in draw(st.sets(token, max_size=3))},
            allowed_token_ids=allowed,
        )
        bad_words = draw(st.lists(st.lists(token, min_size=1, max_size=3).map(tuple), max_size=3))
        stops = sorted(draw(st.sets(token, max_size=2)))
        prompt = draw(st.lists(token, min_size=1, max_size=8))
        output = draw(st.lists(token, max_size=8))
        started = draw(st.integers(0, len(output)))  # the rest is recorded step by step
        cases.append((params, bad_words, stops, prompt, output, started, h))
    logits = torch.tensor(
        draw(st.lists(st.floats(-20, 20, width=32), min_size=n * vocab, max_size=n * vocab))
    ).view(n, vocab)
    return logits, cases


def history_of(vocab: int, cases) -> tuple[TokenHistory, list]:
    """A history started from each row's prompt and first outputs, then fed the rest
    one token per step, as a running request's is; and each row's rules."""
    history = TokenHistory(vocab, torch.device("cpu"))
    rules = [
        logit_rules(p, stop_on=frozenset(stops), bad_words=tuple(words), history_row=h)
        for p, words, stops, _, _, _, h in cases
    ]
    history.start(
        {
            h: (len(prompt), rules[h].window, tuple(prompt + output[:started]))
            for _, _, _, prompt, output, started, h in cases
        }
    )
    for step in range(max(len(c[4]) for c in cases)):
        fed = [
            (h, out[step]) for _, _, _, _, out, started, h in cases if started <= step < len(out)
        ]
        if fed:
            history.record(torch.tensor([h for h, _ in fed]), torch.tensor([t for _, t in fed]))
    return history, rules


@settings(max_examples=200, deadline=None)
@given(rows())
def test_adjusted_logits_are_vllms_adjustments_row_by_row(batch) -> None:
    logits, cases = batch
    history, rules = history_of(logits.shape[1], cases)
    generated = np.array([len(c[4]) for c in cases])
    got = adjusted_logits(logits, rules, generated, history)
    for i, (params, words, stops, prompt, output, _, _) in enumerate(cases):
        want = reference(logits[i], params, prompt, output, words, stops)
        assert torch.equal(got[i].isneginf(), want.isneginf()), (i, got[i], want)
        finite = ~want.isneginf()
        torch.testing.assert_close(got[i][finite], want[finite], rtol=1e-6, atol=1e-5)


@settings(max_examples=100, deadline=None)
@given(rows())
def test_greedy_rows_pick_the_argmax_of_the_adjusted_logits_and_report_raw_logprobs(batch) -> None:
    logits, cases = batch
    history, _ = history_of(logits.shape[1], cases)
    generated = [len(c[4]) for c in cases]
    params = [attrs.evolve(c[0], temperature=0.0, logprobs=0) for c in cases]
    out = sample_with(logits, params, cases, generated, history)
    for i, (p, words, stops, prompt, output, _, _) in enumerate(cases):
        want = reference(logits[i], p, prompt, output, words, stops)
        if want.isneginf().all():
            continue  # nothing to sample: the step reports the row as non-finite
        assert want[out.token_ids[i]] == want.max()
    raw = torch.log_softmax(logits, dim=-1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, raw)


def sample_with(logits, params, cases, generated, history):
    """:func:`sample` over columns whose rules are the engine's (stops, word ids, rows)."""
    columns = SamplingColumns.of(params)
    rules = tuple(logit_rules(p, stop_on=frozenset(stops), bad_words=tuple(words),
                              history_row=h) for p, (_, words, stops, *_, h) in
                  zip(params, cases, strict=True))  # fmt: skip
    columns = SamplingColumns(*columns.arrays(), rules=rules)
    return sample(logits, columns, generated, history=history)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_min_p_masks_tokens_below_min_p_times_the_likeliest(data) -> None:
    vocab = data.draw(VOCAB)
    n = data.draw(st.integers(1, 4))
    scaled = torch.tensor(
        data.draw(st.lists(st.floats(-20, 20, width=32), min_size=n * vocab, max_size=n * vocab))
    ).view(n, vocab)
    min_p = np.array(
        data.draw(st.lists(st.sampled_from([0.0, 0.05, 0.3, 0.9, 1.0]), min_size=n, max_size=n))
    )
    got = mask_min_p_(scaled.clone(), min_p)
    for i in range(n):
        probs = torch.softmax(scaled[i], dim=-1)
        below = probs < probs.max() * float(min_p[i])
        assert torch.equal(got[i].isneginf(), below)
        assert torch.equal(got[i][~below], scaled[i][~below])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_drawn_token_is_never_one_min_p_masks(data) -> None:
    vocab = data.draw(VOCAB)
    logits = torch.tensor(
        data.draw(st.lists(st.floats(-8, 8, width=32), min_size=vocab, max_size=vocab))
    )[None]
    temperature = data.draw(st.sampled_from([0.5, 1.0, 2.0]))
    params = SamplingParams(
        temperature=temperature, min_p=0.3, seed=data.draw(st.integers(0, 2**40))
    )
    token = int(sample(logits, [params], [0]).token_ids[0])
    probs = torch.softmax(logits[0] / temperature, dim=-1)
    assert probs[token] >= 0.3 * probs.max()
