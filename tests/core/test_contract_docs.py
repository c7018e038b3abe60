"""docs/plugins.md documents every contract type field by field, and the code agrees.

Names and order of every field, and for tensor fields their dtype, device and
shape, evaluated on a real padded decode step and a real prefill step.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest
import torch

from kvrunner.engine.step_io import StepInput
from kvrunner.plugin_api import overlap, step_data
from kvrunner.runner.step.step_batch import prepare_step
from kvrunner.runner.step.step_metadata import StepMetadataBuilder
from kvrunner.sampling_params import SamplingParams

DOCS = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
TYPES = ["ModelSpec", "BackendContext", "CacheSpec", "CacheWriteTarget", "StepBatch",
         "StepMetadata", "ForwardContext"]
MAX_BLOCKS = 6


def documented(type_name: str) -> list[tuple[str, str, str, str]]:
    """(field, dtype, device, shape) per row of the type's table."""
    section = DOCS.split(f"#### `{type_name}`", 1)[1].split("\n#### ", 1)[0].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \| ([^|]+) \| ([^|]+) \|", section, re.M)
    return [(name, dtype.strip(), device.strip(), shape.strip().strip("`"))
            for name, dtype, device, shape in rows]


def test_every_public_contract_type_is_documented() -> None:
    public = {name for name, obj in vars(step_data).items()
              if attrs.has(obj) and obj.__module__ == step_data.__name__}
    assert public == set(TYPES)


@pytest.mark.parametrize("type_name", TYPES)
def test_the_table_lists_every_field_in_order(type_name: str) -> None:
    fields = [f.name for f in attrs.fields(getattr(step_data, type_name))]
    assert [row[0] for row in documented(type_name)] == fields


def test_every_overlap_contract_type_is_documented_field_by_field() -> None:
    public = {name: obj for name, obj in vars(overlap).items()
              if attrs.has(obj) and obj.__module__ == overlap.__name__}
    assert set(public) == {"OverlapContext", "MicroBatch", "LayerStack"}
    for name, cls in public.items():
        assert [row[0] for row in documented(name)] == [f.name for f in attrs.fields(cls)]


def _steps() -> list[step_data.StepMetadata]:
    builder = StepMetadataBuilder(max_batch=8, max_tokens=32, max_blocks_per_seq=MAX_BLOCKS,
                                  device=torch.device("cpu"))
    out = []
    for token_ids, starts, padded in [([(1,), (2,), (3,)], [5, 9, 2], 5),
                                      ([(1, 2, 3), (4,)], [0, 7], None)]:
        n = len(token_ids)
        step = StepInput(seq_id=list(range(n)), token_ids=token_ids, start_pos=starts,
                         block_table=[(1, 2, 3)] * n, state_slot=list(range(n)),
                         sample=[True] * n, sampling=[SamplingParams()] * n,
                         num_output_tokens=[0] * n)
        batch = prepare_step(step, block_size=4, num_padded_seqs=padded).batch
        out.append(builder.fill(batch))
    out.append(builder.fill_capture(3))
    return out


def _check_tensor(obj, field: str, dtype: str, device: str, shape: str, sizes: dict) -> None:
    value = getattr(obj, field)
    assert value.dtype == getattr(torch, dtype), field
    assert value.device.type == "cpu", field  # "CPU" and "device" are both the CPU here
    dims = [eval(d, {}, sizes) for d in shape.strip("[]").split(",")]  # noqa: S307
    assert list(value.shape) == dims, field


@pytest.mark.parametrize("type_name", ["StepBatch", "StepMetadata"])
def test_tensor_fields_have_the_documented_dtype_device_and_shape(type_name: str) -> None:
    for step in _steps():
        obj = step.host if type_name == "StepBatch" else step
        sizes = dict(num_seqs=step.num_seqs, num_tokens=step.num_tokens,
                     num_padded_seqs=step.num_padded_seqs,
                     num_padded_tokens=step.num_padded_tokens, max_blocks_per_seq=MAX_BLOCKS,
                     longest=step.host.block_table_array.shape[1])
        checked = 0
        for field, dtype, device, shape in documented(type_name):
            if dtype not in ("-", "any integer"):
                assert device in ("CPU", "device")
                _check_tensor(obj, field, dtype, device, shape, sizes)
                checked += 1
        assert checked >= 4


def test_the_step_metadata_host_side_lives_on_the_cpu() -> None:
    for step in _steps():
        for field, _, device, _ in documented("StepBatch"):
            if device == "CPU":
                assert getattr(step.host, field).device.type == "cpu"


def _table_after(heading: str, first_column: str) -> list[list[str]]:
    """The rows of the first table under ``heading`` whose header starts with
    ``first_column``, cells stripped of backticks."""
    section = DOCS.split(heading, 1)[1]
    table = section.split(f"| {first_column} |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    return [[cell.strip().replace("`", "") for cell in row.strip("|").split("|")] for row in rows]


def test_the_hook_table_names_every_hook_and_what_is_required() -> None:
    from kvrunner.plugin_api import hookspecs
    from kvrunner.plugin_host.plugins import hook_names

    rows = {hook: (layer, plugin) for hook, layer, plugin in _table_after("## Hooks", "hook")}
    assert set(rows) == hook_names()
    for hook, (layer, plugin) in rows.items():
        assert (layer == "required") == (hook in hookspecs.REQUIRED_OF_LAYER_BACKENDS), hook
        assert (plugin == "required") == (hook in hookspecs.REQUIRED_OF_OVERLAP_PLUGINS), hook
        if hook in hookspecs.REQUIRED_WITH:
            assert layer == f"required with {hookspecs.REQUIRED_WITH[hook]}", hook
        else:
            assert layer.startswith(("required", "optional", "-")), hook
            assert layer != "required" or hook in hookspecs.REQUIRED_OF_LAYER_BACKENDS


def test_the_factory_table_lists_what_the_plugin_api_declares() -> None:
    from kvrunner.plugin_api import LayerBackendFactory

    rows = _table_after("The entry point names the *factory*", "attribute")
    declared = list(LayerBackendFactory.__annotations__)
    assert [row[0] for row in rows] == declared
    required = {row[0] for row in rows if row[1].startswith("yes")}
    assert required == {"plugin_api_version", "layer_types", "cache_rows"}
    assert "supports_overlap" not in required


def test_the_conformance_extra_the_docs_name_exists() -> None:
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "hypothesis" in " ".join(pyproject["project"]["optional-dependencies"]["conformance"])
    assert "pip install 'kvrunner[conformance]'" in DOCS


def test_the_documented_plugin_api_version_is_the_codes_everywhere_it_is_shown() -> None:
    version = step_data.PLUGIN_API_VERSION
    assert f"Plugin API version: **{version}**" in DOCS
    sample = DOCS.split("kvrunner backends\n```", 1)[1].split("```", 2)[1]
    shown = re.findall(r"^\w+\s+kvrunner-\S+\s+\S+\s+.*?(\d+)\s*$", sample, re.M)
    assert shown and set(shown) == {str(version)}


def test_the_kit_table_lists_every_check_once() -> None:
    from kvrunner.testing.conformance import CHECKS

    table = DOCS.split("| check | property |", 1)[1].split("\n\n", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert sorted(listed) == sorted(CHECKS)
