"""``--weight-transfer-config``: vLLM's JSON object naming the backend; those kvrunner
serves (``nccl``, ``ipc`` with vLLM's packing keys) are taken, anything else is refused
at start-up by name."""

from __future__ import annotations

import pytest

from kvrunner.config import ConfigError
from kvrunner.serve.settings import ServeSettings, weight_transfer_backend


def test_the_nccl_backend_is_taken() -> None:
    assert weight_transfer_backend('{"backend": "nccl"}') == "nccl"
    assert ServeSettings(weight_transfer_backend="nccl").weight_transfer_backend == "nccl"


@pytest.mark.parametrize("text", [
    '{"backend": "ipc"}',
    '{"backend": "ipc", "packed": true, "packed_buffer_size_bytes": 1073741824}',
])
def test_the_ipc_backend_is_taken_with_vllms_keys(text) -> None:
    assert weight_transfer_backend(text) == "ipc"
    assert ServeSettings(weight_transfer_backend="ipc").weight_transfer_backend == "ipc"


@pytest.mark.parametrize(("text", "says"), [
    ('{"backend": "ipc", "master_port": 1}', "'master_port'"),
    ('{"backend": "ipc", "packed": "yes"}', "packed is 'yes'"),
    ('{"backend": "ipc", "packed_buffer_size_bytes": 0}', "packed_buffer_size_bytes is 0"),
    ('{"backend": "sparse_nccl"}', "'sparse_nccl'"),
    ('{"backend": "nccl", "packed": true}', "one key 'backend'"),
    ('["nccl"]', "one key 'backend'"),
    ("{backend: nccl}", "not JSON"),
])
def test_anything_else_is_refused_by_name(text, says) -> None:
    with pytest.raises(ConfigError, match="--weight-transfer-config") as refused:
        weight_transfer_backend(text)
    assert says in str(refused.value)
