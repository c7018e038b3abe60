"""The command line explains itself: help for every flag, one-line errors, early checks,
a clean Ctrl-C, and no silent overwrite."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

import kvrunner
from kvrunner.cli.help import FIELD_HELP
from kvrunner.cli.main import build_parser, main
from kvrunner.config import _SECTIONS, EngineConfig

SMALL = ["--max-num-seqs", "2", "--num-blocks", "16", "--max-model-len", "64", "--enforce-eager"]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", ["backends", "make-tiny", "generate", "rollout"])
def test_every_flag_has_help_and_config_flags_show_their_default(command) -> None:
    for action in subcommands()[command]._actions:
        assert action.help and action.help.strip(), f"{command}: {action.option_strings}"
        if action.dest in FIELD_HELP and action.option_strings:
            assert "default:" in action.help, action.option_strings


def test_every_config_field_has_a_description() -> None:
    fields = [f.name for f in attrs.fields(EngineConfig) if f.name not in _SECTIONS]
    fields += [f.name for k in _SECTIONS.values() for f in attrs.fields(k)]
    assert sorted(fields) == sorted(FIELD_HELP)


def test_choices_are_listed_in_the_help(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "{auto,float32,bfloat16,float16}" in out and "{auto,nccl,symm_mem}" in out
    assert "``" not in out and ":class:" not in out


def test_version_and_a_plain_description(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == (
        f"kvrunner {kvrunner.__version__}"
    )
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out


def test_bad_capture_sizes_say_what_is_expected(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "x", "--capture-sizes", "1,x"])
    err = capsys.readouterr().err
    assert "comma-separated list of batch sizes" in err and "<lambda>" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", "nope.toml"], "config file 'nope.toml' does not exist"),
        (["--device", "tpu"], "device must be one of auto, cpu, cuda or cuda:<index>"),
        (["--max-tokens", "0"], "max_tokens must be >= 1"),
        (["--top-p", "nan"], "top_p must be a finite number"),
        (["--token-ids"], "'x' is not a comma-separated list of token ids"),
    ],
)
def test_mistakes_are_one_line_and_found_before_loading(monkeypatch, capsys, argv,
                                                        message) -> None:
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("kvrunner.llm.LLM._start", no_load)
    assert main(["generate", "x", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_verbose_adds_the_traceback(capsys) -> None:
    assert main(["generate", "x", "--device", "tpu", "-v"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().endswith("got 'tpu'")


def test_a_full_pool_names_request_0_once(capsys) -> None:
    args = ["generate", "x", "--num-blocks", "1", "--max-tokens", "40", "--max-model-len", "64",
            "--enforce-eager", "--max-num-seqs", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("request 0") == 1


def test_generate_token_ids_on_a_model_without_tokenizer(tmp_path, capsys) -> None:
    model = tmp_path / "m"
    assert main(["make-tiny", str(model)]) == 0
    (model / "tokenizer.json").unlink()
    assert main(["generate", "1,2,3", "--token-ids", "--model", str(model), "--max-tokens",
                 "3", *SMALL]) == 0
    out = capsys.readouterr()
    assert "--- [1, 2, 3] -> length" in out.out
    assert "generating" in out.err  # progress while it runs
    assert main(["generate", "hello", "--model", str(model), *SMALL]) == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_make_tiny_refuses_a_non_empty_directory_unless_forced(tmp_path, capsys) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    assert main(["make-tiny", str(target)]) == 2
    assert "not empty" in capsys.readouterr().err and not (target / "config.json").exists()
    assert main(["make-tiny", str(target), "--force"]) == 0
    assert (target / "config.json").exists() and (target / "notes.txt").read_text() == "mine"


def test_make_tiny_where_nothing_can_be_written_is_one_line(tmp_path, capsys) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    for target, why in (("/proc/nope", "No such file or directory"),
                        (str(blocker / "m"), "Not a directory")):
        assert main(["make-tiny", target]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvrunner: error: cannot write a checkpoint in {target}: ")
        assert why in err and err.count("\n") == 1 and "Traceback" not in err


def test_an_unwritable_kvrunner_home_is_one_line_naming_it(tmp_path, monkeypatch,
                                                          capsys) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KVRUNNER_HOME", str(blocker / "home"))
    assert main(["generate", "hi", "--model", "tiny-qwen3", *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvrunner: error: cannot write the embedded model tiny-qwen3 in "
                          f"{blocker / 'home' / 'models'}: ")
    assert "set KVRUNNER_HOME to a writable directory" in err and err.count("\n") == 1


@pytest.mark.parametrize("tp", [1, 2])
def test_ctrl_c_exits_130_without_a_traceback(tp) -> None:
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it."""
    cmd = [sys.executable, "-m", "kvrunner.cli.main", "generate", "a", "b", "--max-tokens", "2000",
           "--max-model-len", "2048", "--ignore-eos", "--enforce-eager", "--max-num-seqs", "2",
           "--tensor-parallel-size", str(tp)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    seen = ""
    while "generating" not in seen:
        char = proc.stderr.read(1)
        assert char, f"exited before generating: {seen}"
        seen += char
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "kvrunner: interrupted" in err, err
    for noise in ("Traceback", "leaked", "terminate"):
        assert noise not in err, err


def test_a_crashed_rank_leaves_nothing_behind_for_the_resource_tracker() -> None:
    """A rank that dies without cleaning up (os._exit, as a segfault or the OOM killer)
    must not own a named semaphore: the driver's exit would then warn of a leak."""
    hooks = '{"fail": {"rank": 0, "at": "step", "step": 2, "mode": "exit"}}'
    cmd = [sys.executable, "-m", "kvrunner.cli.main", "generate", "a", "b", "--max-tokens", "20",
           "--max-model-len", "2048", "--ignore-eos", "--enforce-eager", "--max-num-seqs", "2",
           "--tensor-parallel-size", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "KVRUNNER_TP_TEST_HOOKS": hooks})
    assert run.returncode == 2, run.stderr
    assert "tensor-parallel rank 0 failed during a step: ProcessDied" in run.stderr
    assert "loading weights" in run.stderr  # rank 0 drew a progress bar: it had a lock
    assert "leaked" not in run.stderr, run.stderr


def test_a_tp_script_without_main_guard_is_told_the_real_cause(tmp_path: Path) -> None:
    script = tmp_path / "serve.py"
    script.write_text(
        "import kvrunner\n"
        "llm = kvrunner.LLM('tiny-qwen3', tensor_parallel_size=2, enforce_eager=True,\n"
        "                   max_num_seqs=2, max_model_len=64)\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    assert 'if __name__ == "__main__":' in run.stderr and "line 2" in run.stderr
    assert "ProcessDied" not in run.stderr


@pytest.mark.parametrize("rounds", ["0", "-2", "two"])
def test_rollout_refuses_a_round_count_below_one_before_loading(rounds, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["rollout", "--rounds", rounds])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--rounds" in err and "Traceback" not in err
