"""The main job: ``kvrunner rollout`` loses nothing across sleep / push / wake rounds,
and says so (exit 1) when something is lost."""

from __future__ import annotations

import pytest
import torch

from kvrunner.cli import main as cli
from kvrunner.runner.weight_residency import WeightResidency

ARGS = ["rollout", "--model", "tiny-qwen3", "--rounds", "3", "--batch", "3", "--max-tokens", "6",
        "--max-num-seqs", "4", "--capture-sizes", "1,2,4"]  # fmt: skip


def table_rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("-----")) + 1
    return [line.split() for line in lines[start:] if line.split()[0].isdigit()]


@pytest.mark.parametrize("level", ["1", "2"])
def test_every_round_repeats_round_1_with_the_same_pool(kvrunner_home, capsys, level) -> None:
    assert cli.main([*ARGS, "--sleep-level", level, "--update", "same"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert len({r[6] for r in rows}) == 1, "the KV block count changed"
    assert [r[7] for r in rows] == ["0"] * 3 and [r[8] for r in rows] == ["yes"] * 3
    assert all(float(r[5]) > 0 for r in rows), "a sleep freed nothing"


def test_perturbed_rounds_alternate_and_the_own_weights_come_back_exactly(
    kvrunner_home, capsys
) -> None:
    assert cli.main([*ARGS, "--rounds", "4", "--sleep-level", "2", "--update", "perturbed"]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert [r[8] for r in rows] == ["yes", "-", "yes", "-"]


def test_weights_lost_in_a_sleep_make_the_job_fail(kvrunner_home, capsys, monkeypatch) -> None:
    def restore_without_contents(self: WeightResidency) -> None:
        for s in self._storages:
            s.storage.resize_(s.nbytes)
            torch.empty(0, dtype=torch.uint8).set_(s.storage, 0, (s.nbytes,), (1,)).zero_()
        self.state = "resident"

    monkeypatch.setattr(WeightResidency, "restore", restore_without_contents)
    assert cli.main([*ARGS, "--sleep-level", "2"]) == 1
    out = capsys.readouterr().out
    assert [r[8] for r in table_rows(out)][1:] == ["NO", "NO"]
    assert "rounds that lost anything: some" in out


def tokenizer_less(tmp_path) -> str:
    model = tmp_path / "m"
    assert cli.main(["make-tiny", str(model)]) == 0
    (model / "tokenizer.json").unlink()
    return str(model)


SHORT = ["rollout", "--rounds", "2", "--batch", "2", "--max-tokens", "4", "--max-num-seqs", "4",
         "--capture-sizes", "1,2,4", "--update", "same"]  # fmt: skip


def test_a_checkpoint_without_a_tokenizer_is_refused_before_it_loads(
    kvrunner_home, tmp_path, capsys
) -> None:
    model = tokenizer_less(tmp_path)
    capsys.readouterr()
    assert cli.main([*SHORT, "--model", model]) == 2
    err = capsys.readouterr().err
    assert "rollout's text prompts needs a tokenizer" in err and "no tokenizer.json" in err
    assert "pass --token-ids (or --prompt-len L)" in err
    assert "loading weights" not in err  # no model load was spent on it
    assert cli.main([*SHORT, "--skip-tokenizer-init"]) == 2  # the embedded one, told to skip
    assert "skip_tokenizer_init is set" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "length"), [(["--prompt-len", "12"], 12),
                                               (["--token-ids"], cli.DEFAULT_PROMPT_LEN)])
def test_token_id_prompts_roll_out_on_a_checkpoint_without_a_tokenizer(
    tmp_path, capsys, flags, length
) -> None:
    model = tokenizer_less(tmp_path)
    capsys.readouterr()
    assert cli.main([*SHORT, "--model", model, *flags]) == 0
    out = capsys.readouterr().out
    assert f"prompts: {length} random token ids" in out
    rows = table_rows(out)
    assert [r[8] for r in rows] == ["yes", "yes"] and [r[7] for r in rows] == ["0", "0"]


def test_token_id_prompts_are_the_seeds_and_fit_the_vocabulary() -> None:
    from kvrunner.cli.rollout import rollout_token_prompts

    a = rollout_token_prompts(3, 7, 50, seed=1)
    assert a == rollout_token_prompts(3, 7, 50, seed=1) != rollout_token_prompts(3, 7, 50, seed=2)
    assert [len(p) for p in a] == [7] * 3 and len({tuple(p) for p in a}) == 3
    assert all(0 <= t < 50 for p in a for t in p)


@pytest.mark.parametrize("flag", ["--batch", "--max-tokens", "--prompt-len"])
def test_zero_counts_are_usage_errors(capsys, flag) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["rollout", flag, "0"])
    assert info.value.code == 2 and "must be at least 1" in capsys.readouterr().err
