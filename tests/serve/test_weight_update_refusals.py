"""``/update_weights_from_disk`` is a transaction: a refused checkpoint (wrong shape,
missing or extra tensor, an integer dtype, NaN in its last tensor) is a 400 naming
the tensor, and the server goes on serving the same greedy tokens at the same
weight version."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from test_weight_transactions import CHECKPOINT_FAULTS, last_name  # noqa: E402

from kvrunner.models.tiny import write_tiny_checkpoint  # noqa: E402

GREEDY = {"input_ids": [5, 6, 7, 8, 9],
          "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    """A checkpoint of the served model's shapes, with other values."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("other") / "m", seed=1)


@pytest.mark.parametrize("fault", sorted(CHECKPOINT_FAULTS))
def test_a_refused_checkpoint_leaves_the_server_serving_the_old_weights(
    server, other, tmp_path, fault
) -> None:
    change, name, why = CHECKPOINT_FAULTS[fault]
    bad = tmp_path / "bad"
    shutil.copytree(other, bad)
    tensors = load_file(bad / "model.safetensors")
    change(tensors)
    save_file(tensors, bad / "model.safetensors")
    name = name or last_name(load_file(bad / "model.safetensors"))
    with server.client() as client:
        version = client.get("/get_weight_version").json()["weight_version"]
        before = client.post("/generate", json=GREEDY).json()["output_ids"]
        refused = client.post("/update_weights_from_disk", json={
            "model_path": str(bad), "weight_version": "refused"})
        assert refused.status_code == 400, refused.text
        body = refused.json()
        assert body["success"] is False and name in body["message"] and why in body["message"]
        assert client.get("/get_weight_version").json()["weight_version"] == version
        after = client.post("/generate", json=GREEDY)
        assert after.status_code == 200, after.text
        assert after.json()["output_ids"] == before
