"""``--weight-transfer-config``: vLLM's JSON object naming the backend; the one kvrunner
serves (``nccl``) is taken, anything else is refused at start-up by name."""

from __future__ import annotations

import pytest

from kvrunner.config import ConfigError
from kvrunner.serve.settings import ServeSettings, weight_transfer_backend


def test_the_nccl_backend_is_taken() -> None:
    assert weight_transfer_backend('{"backend": "nccl"}') == "nccl"
    assert ServeSettings(weight_transfer_backend="nccl").weight_transfer_backend == "nccl"


@pytest.mark.parametrize(("text", "says"), [
    ('{"backend": "ipc"}', "'ipc'"),
    ('{"backend": "sparse_nccl"}', "'sparse_nccl'"),
    ('{"backend": "nccl", "packed": true}', "one key 'backend'"),
    ('["nccl"]', "one key 'backend'"),
    ("{backend: nccl}", "not JSON"),
])
def test_anything_else_is_refused_by_name(text, says) -> None:
    with pytest.raises(ConfigError, match="--weight-transfer-config") as refused:
        weight_transfer_backend(text)
    assert says in str(refused.value)
