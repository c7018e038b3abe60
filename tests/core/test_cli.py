"""The ``kvrunner`` command line."""

from __future__ import annotations

import json
import re

from kvrunner import plugin_api
from kvrunner.cli.main import main


def test_backends_lists_paged_from_its_distribution_with_its_plugin_api(capsys) -> None:
    assert main(["backends"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["paged"][1] == "kvrunner-paged"
    assert rows["paged"][3] == "full_attention"
    assert rows["paged"][-1] == str(plugin_api.PLUGIN_API_VERSION)
    assert "gdn" in rows and rows["gdn"][1] == "kvrunner-gdn"


def test_make_tiny_writes_a_loadable_checkpoint(tmp_path, capsys) -> None:
    assert main(["make-tiny", str(tmp_path / "m"), "--seed", "3"]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert (tmp_path / "m" / "tokenizer.json").is_file()


def test_generate_prints_text_for_each_prompt(tmp_path, capsys) -> None:
    model = tmp_path / "m"
    main(["make-tiny", str(model)])
    capsys.readouterr()
    code = main(
        [
            "generate",
            "hello world",
            "the engine",
            "--model",
            str(model),
            "--max-tokens",
            "4",
            "--max-num-seqs",
            "2",
            "--num-blocks",
            "32",
            "--max-model-len",
            "64",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("--- ") == 2 and "'hello world'" in out


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path, capsys) -> None:
    assert main(["generate", "x", "--model", str(tmp_path / "missing")]) == 2
    assert "neither a directory nor an embedded default" in capsys.readouterr().err
    assert main(["generate", "x", "--block-size", "0"]) == 2
    assert "block_size" in capsys.readouterr().err
    assert main(["generate", "x", "--full-attention", "nope"]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and re.search(r"installed: \[.*'paged'.*\]", err)
