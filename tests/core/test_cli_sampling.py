"""``kvrunner generate``'s sampling flags (--logprobs, --stop-token-ids, --stop, --n)
print what the API returns, and what they cannot serve is refused before the model
loads."""

from __future__ import annotations

import re

import pytest

from kvrunner import LLM, SamplingParams
from kvrunner.cli.main import main

SMALL = ["--max-num-seqs", "4", "--num-blocks", "32", "--max-model-len", "64", "--enforce-eager"]
ENGINE = dict(max_num_seqs=4, num_blocks=32, max_model_len=64, enforce_eager=True)
PROMPT = [5, 9, 2, 7]


def headers(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("--- ")]


def token_lines(out: str) -> list[list[tuple[int, float, dict[int, float]]]]:
    """Per sample, its --logprobs lines as (token, logprob, top)."""
    samples: list[list] = []
    for line in out.splitlines():
        if line.startswith("--- "):
            samples.append([])
        elif m := re.match(r"  \[\d+\] (\d+) (-?[\d.]+|-inf)(?:  top: (.*))?$", line):
            top = dict((int(t), float(v)) for t, v in
                       (item.split() for item in m.group(3).split(" | "))) if m.group(3) else {}
            samples[-1].append((int(m.group(1)), float(m.group(2)), top))
    return samples


@pytest.fixture(scope="module")
def api():
    with LLM("tiny-qwen3", skip_tokenizer_init=True, **ENGINE) as llm:
        yield llm


def test_logprobs_and_n_print_each_sample_as_the_api_returns_it(kvrunner_home, api,
                                                                 capsys) -> None:
    args = ["generate", ",".join(map(str, PROMPT)), "--token-ids", "--max-tokens", "5",
            "--temperature", "1", "--sample-seed", "7", "--n", "3", "--logprobs", "2",
            "--ignore-eos", "--skip-tokenizer-init", *SMALL]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert headers(out) == [f"--- {PROMPT!r} [sample {k}/3] -> length" for k in (1, 2, 3)]
    want = api.generate(PROMPT, SamplingParams(max_tokens=5, temperature=1.0, seed=7, n=3,
                                               logprobs=2, ignore_eos=True))
    got = token_lines(out)
    assert [[t for t, _, _ in s] for s in got] == [o.token_ids for o in want]
    for sample, ref in zip(got, want, strict=True):
        assert [round(lp, 4) for _, lp, _ in sample] == [round(x, 4) for x in ref.logprobs]
        assert [list(top) for _, _, top in sample] == [list(t) for t in ref.top_logprobs]
        assert all(len(top) == 2 for _, _, top in sample)


def test_stop_token_ids_end_a_request_and_say_which(kvrunner_home, api, capsys) -> None:
    greedy = api.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0,
                                                 ignore_eos=True))[0].token_ids
    stop = greedy[3]
    args = ["generate", ",".join(map(str, PROMPT)), "--token-ids", "--max-tokens", "8",
            "--ignore-eos", "--stop-token-ids", f"{stop},{stop}", "--skip-tokenizer-init",
            *SMALL]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert headers(out) == [f"--- {PROMPT!r} -> stop ({stop})"]
    assert out.splitlines()[1] == str(greedy[: greedy.index(stop) + 1])


def test_repeated_stop_strings_each_end_a_request(kvrunner_home, capsys) -> None:
    with LLM("tiny-qwen3", **ENGINE) as llm:
        text = llm.generate("The river", SamplingParams(max_tokens=20, temperature=0.0,
                                                         ignore_eos=True))[0].text
    first, second = text[12:15], text[4:7]  # the second one comes first in the text
    args = ["generate", "The river", "--max-tokens", "20", "--ignore-eos", "--stop", first,
            "--stop", second, *SMALL]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert headers(out) == [f"--- 'The river' -> stop ({second!r})"]
    assert out.split("\n", 1)[1] == text[: text.index(second)] + "\n"


def tokenizer_less(tmp_path) -> str:
    model = tmp_path / "m"
    assert main(["make-tiny", str(model)]) == 0
    (model / "tokenizer.json").unlink()
    return str(model)


def test_stop_strings_without_a_tokenizer_are_refused_before_loading(tmp_path,
                                                                      capsys) -> None:
    model = tokenizer_less(tmp_path)
    capsys.readouterr()
    args = ["generate", "1,2,3", "--token-ids", "--stop", "x", "--model", model, *SMALL]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--stop needs a tokenizer" in err and "has no tokenizer.json" in err
    assert "use --stop-token-ids" in err
    assert "loading weights" not in err  # refused before the model loaded
    assert main(["generate", "hi", "--model", model, *SMALL]) == 2
    err = capsys.readouterr().err
    assert "a text prompt needs a tokenizer" in err and "loading weights" not in err


@pytest.mark.parametrize(("flags", "named"), [
    (["--n", "0"], "SamplingParams.n must be >= 1"),
    (["--logprobs", "-1"], "SamplingParams.logprobs must be >= 0"),
    (["--logprobs", "21"], "SamplingParams.logprobs=21 exceeds max_logprobs=20"),
    (["--stop", ""], "SamplingParams.stop must hold non-empty strings"),
])
def test_bad_sampling_flags_are_one_line_errors(kvrunner_home, capsys, flags, named) -> None:
    assert main(["generate", "1,2", "--token-ids", *flags, *SMALL]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_a_bad_stop_token_list_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "x", "--stop-token-ids", "1,x"])
    assert info.value.code == 2
    assert "not a comma-separated list of token ids" in capsys.readouterr().err
