"""The tutorial's backend (examples/minimal_backend) installs, is selectable, and passes the kit.

docs/plugins.md shows its files verbatim; this keeps the two the same.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvrunner import LLM, SamplingParams
from kvrunner.cli.main import main
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.testing.conformance import (
    BATCH_INVARIANCE_PROMISE,
    CHECKS,
    GPU_PATH_ONLY,
    ConformanceError,
    Target,
    run_check,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "minimal_backend"
FILES = ["pyproject.toml", "kvrunner_minimal/__init__.py"]


@pytest.mark.parametrize("name", FILES)
def test_the_docs_show_the_example_files_verbatim(name: str) -> None:
    docs = (ROOT / "docs" / "plugins.md").read_text()
    blocks = re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", docs, flags=re.S)
    shown = {path: text for path, text in blocks}
    assert shown[f"examples/minimal_backend/{name}"] == (EXAMPLE / name).read_text()


def test_kvrunner_backends_lists_it(minimal_installed, capsys) -> None:
    assert main(["backends"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["minimal"][1:4] == ["kvrunner-minimal", "0.1.0", "full_attention"]


@pytest.mark.parametrize("check", [c for c in CHECKS
                                   if c not in GPU_PATH_ONLY | BATCH_INVARIANCE_PROMISE])
def test_it_passes_the_conformance_kit(minimal_installed, check: str) -> None:
    (target,) = Target.of("minimal")
    assert 1 <= run_check(target, check, max_examples=4) <= 4


def test_the_cuda_path_check_names_why_it_is_an_eager_backend(minimal_installed) -> None:
    """The tutorial's attention loops over sequences in Python, sized by ``tolist()``
    of the step's offsets and PAD rows dropped by a boolean mask: right, and simple,
    on the CPU; on CUDA each is a wait for the device, which the kit says."""
    (target,) = Target.of("minimal", use_triton=True)
    with pytest.raises(ConformanceError, match="read a tensor's value on the host"):
        run_check(target, "forward_reads_nothing_on_the_host", max_examples=2)


def test_check_backend_command_passes(minimal_installed, capsys) -> None:
    assert main(["check-backend", "minimal", "--examples", "2"]) == 0
    assert "minimal: all checks passed" in capsys.readouterr().out


def test_check_backend_with_tbo_on_top_passes(minimal_installed, capsys) -> None:
    """It declares ``supports_overlap`` and keeps the promise: its layer reads its write
    buffer from the metadata, so each micro-batch writes its own slots."""
    assert main(["check-backend", "minimal", "--overlap", "tbo", "--examples", "2"]) == 0
    out = capsys.readouterr().out
    assert "minimal+tbo: all checks passed" in out
    assert "ok   minimal+tbo full_attention metadata_carries_what_layers_read" in out


def test_selected_by_keyword_it_generates_what_paged_generates(minimal_installed, tmp_path) -> None:
    model = str(write_tiny_checkpoint(tmp_path / "tiny", kind="qwen3", seed=0))
    settings = dict(model=model, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96,
                    block_size=4, num_blocks=48, audit=True)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(**settings, full_attention="minimal") as llm:
        mine = [o.token_ids for o in llm.generate(prompts, greedy)]
        llm.recapture()  # under the audit, after serving
    with LLM(**settings) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == mine
    # under two-batch overlap cutting every step, with the audit on: the same tokens
    with LLM(**settings, full_attention="minimal", overlap="tbo", overlap_min_tokens=2,
             overlap_min_decode_seqs=2) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == mine
