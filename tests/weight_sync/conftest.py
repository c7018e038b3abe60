"""Weight-sync test set-up: transformers checkpoints (through the parity helpers of
tests/core), their greedy tokens, and a trainer in its own process."""

from __future__ import annotations

import multiprocessing
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from push_kit import ENGINE, SERVER_FLAGS, SERVER_KEY  # noqa: E402
from test_generate_hf_parity import hf_greedy, save_hf_qwen3  # noqa: E402

from kvrunner.models.tiny import write_tiny_checkpoint  # noqa: E402

pytest.importorskip("transformers")


class Checkpoints:
    """transformers Qwen3 checkpoints by seed, each also rounded to a dtype, with the
    greedy tokens transformers gives on each (computed once)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._expected: dict[tuple[int, str], list[list[int]]] = {}

    def path(self, seed: int) -> Path:
        path = self.root / f"seed{seed}"
        if not path.exists():
            save_hf_qwen3(path, tie=False, seed=seed)
            tiny = write_tiny_checkpoint(self.root / "tok", kind="qwen3", seed=0)
            shutil.copy(tiny / "tokenizer.json", path / "tokenizer.json")
        return path

    def rounded(self, seed: int, dtype: str) -> Path:
        """The seed's checkpoint with every tensor rounded to ``dtype`` (what the engine
        holds after a push in that dtype), stored in float32."""
        if dtype == "float32":
            return self.path(seed)
        from safetensors.torch import load_file, save_file

        path = self.root / f"seed{seed}-{dtype}"
        if not path.exists():
            shutil.copytree(self.path(seed), path)
            file = path / "model.safetensors"
            tensors = load_file(file)
            save_file({k: v.to(getattr(torch, dtype)).float() for k, v in tensors.items()}, file,
                      metadata={"format": "pt"})
        return path

    def expected(self, seed: int, dtype: str) -> list[list[int]]:
        key = (seed, dtype)
        if key not in self._expected:
            self._expected[key] = hf_greedy(self.rounded(seed, dtype))
        return self._expected[key]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("weight_sync"))


@pytest.fixture(scope="module")
def llm(checkpoints: Checkpoints) -> Iterator[Any]:
    """A TP=1 engine on checkpoint seed 1, one per test module."""
    from kvrunner import LLM

    engine = LLM(model=str(checkpoints.path(1)), **ENGINE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def llm_tp2(checkpoints: Checkpoints) -> Iterator[Any]:
    """A TP=2 engine (gloo), shared by the modules that need one (it starts slowly)."""
    from kvrunner import LLM

    engine = LLM(model=str(checkpoints.path(1)), tensor_parallel_size=2, max_num_seqs=4,
                 max_num_batched_tokens=64, max_model_len=64, num_blocks=64, block_size=4)
    yield engine
    engine.shutdown()


class Trainer:
    """The trainer process (tests/weight_sync/trainer_process.py) and its pipe."""

    def __init__(self) -> None:
        import trainer_process

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=trainer_process.serve, args=(child,), daemon=True)
        self.process.start()

    def start(self, **job: Any) -> tuple[Any, bytes]:
        """Start a push; returns the sender's address and authkey."""
        self.conn.send({k: str(v) if isinstance(v, Path) else v for k, v in job.items()})
        kind, address, authkey = self.conn.recv()
        assert kind == "listening"
        return address, authkey

    def result(self, timeout: float = 60) -> tuple[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError("the trainer did not answer")
        return self.conn.recv()

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send(None)
        self.process.join(10)


@pytest.fixture(scope="module")
def trainer() -> Iterator[Trainer]:
    process = Trainer()
    yield process
    process.stop()


@pytest.fixture
def fresh_trainer() -> Iterator[Trainer]:
    process = Trainer()
    yield process
    process.stop()


def weights_server(checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory,
                   backend: str, engine_flags: tuple[str, ...] = ()) -> Iterator[Any]:
    """A live ``kvrunner serve`` on checkpoint seed 1 with the RL routes and vLLM's
    weight transfer ``backend`` on (the push tests' engine flags, and ``engine_flags``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
    from serve_kit import start_server

    tmp = tmp_path_factory.mktemp("weights_server")
    flags = ["--enable-rl-endpoints", "--weight-transfer-config",
             f'{{"backend": "{backend}"}}']
    started = start_server(tmp, tmp, "weights", flags, api_key=SERVER_KEY,
                           model=str(checkpoints.path(1)),
                           engine_flags=[*SERVER_FLAGS, *engine_flags])
    started.wait_ready()
    yield started
    assert started.stop() == 0


@pytest.fixture(scope="module")
def server(checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A live ``kvrunner serve`` on checkpoint seed 1 with the RL routes and vLLM's
    weight transfer (``nccl``) on, one per test module."""
    yield from weights_server(checkpoints, tmp_path_factory, "nccl")


@pytest.fixture(scope="module")
def ipc_server(checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory,
               ) -> Iterator[Any]:
    """As ``server``, with vLLM's ``ipc`` weight-transfer backend."""
    yield from weights_server(checkpoints, tmp_path_factory, "ipc")


@pytest.fixture(scope="module")
def gpu_ipc_server(checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory,
                   ) -> Iterator[Any]:
    """As ``ipc_server``, taking 30% of the GPU (which it shares with an engine and a
    trainer)."""
    yield from weights_server(checkpoints, tmp_path_factory, "ipc",
                              ("--num-blocks", "64", "--gpu-memory-utilization", "0.3"))
