"""SkyRL's colocated CUDA IPC push on a GPU, its trainer side replayed from SkyRL's
source in a process of its own on the same GPU (peer_trainers.py, ``skyrl_ipc``, the
commit cited there): ``/sleep?level=2``, ``/wake_up?tags=weights``,
``skyrl_start_weight_update``, per chunk one flat buffer of the generator dtype
shared with torch's ``reduce_tensor`` and posted to ``/collective_rpc``
``update_weights_ipc`` with ``sizes`` in elements, ``skyrl_finish_weight_update``,
``/wake_up?tags=kv_cache``. The server's greedy tokens then equal its own loaded from
the pushed checkpoint rounded to that dtype (and not those it had before)."""

from __future__ import annotations

import pytest
import torch
from test_peer_trainers import run_trainer, weight_version
from test_weight_routes import greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_skyrls_packed_chunks_land_through_its_worker_extension_calls(
    gpu_ipc_server, checkpoints, dtype, tmp_path
) -> None:
    with gpu_ipc_server.client() as client:
        loaded = client.post("/update_weights_from_disk",
                             json={"model_path": str(checkpoints.rounded(2, dtype))})
        assert loaded.status_code == 200, f"{loaded.text}\n{gpu_ipc_server.log()}"
        expected = greedy(client)
        restored = client.post("/update_weights_from_disk",
                               json={"model_path": str(checkpoints.path(1))})
        assert restored.status_code == 200, f"{restored.text}\n{gpu_ipc_server.log()}"
        before, version = greedy(client), weight_version(client)
        assert before != expected
        steps = run_trainer(gpu_ipc_server, tmp_path, peer="skyrl_ipc",
                            path=str(checkpoints.path(2)), dtype=dtype, chunks=3)
        answers = [s["answer"] for s in steps if s["step"] in
                   ("start", "chunk", "finish")]
        assert answers == [{"results": [None]}] * 5
        assert greedy(client) == expected
        assert weight_version(client) != version
