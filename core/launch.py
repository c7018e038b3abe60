"""Tensor parallelism under torchrun (or any env:// launcher), one node or many.

Every rank runs the same program; the launcher sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. :func:`launch` meets the
other ranks through the standard env:// rendezvous, builds this rank's runner,
and then:

- on rank 0 returns an :class:`~kvrunner.llm.LLM` whose engine broadcasts each
  step to the group (``LLM.shutdown()`` releases the other ranks);
- on every other rank serves those steps until rank 0 shuts down, then returns
  ``None``. A rank that fails prints its error, reports it for rank 0 to raise,
  and ends its process at once with status 0 (so torchrun does not kill rank 0
  before it has named the failed rank); ``launch`` does not return there.

So a script reads::

    llm = launch(model="/ckpt", enforce_eager=False)
    if llm is not None:               # rank 0
        outputs = llm.generate(prompts, params)
        llm.shutdown()

or, as a command: ``torchrun --nproc-per-node 2 -m kvrunner.launch
--model /ckpt --prompt "Hello" --max-tokens 16``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from kvrunner.config import ConfigError, EngineConfig
from kvrunner.distributed.control import BroadcastChannel
from kvrunner.distributed.errors import RankFailure
from kvrunner.distributed.fault_injection import FaultPlan
from kvrunner.distributed.group import DistGroup


def launch(
    model: str | None = None,
    *,
    config_file: str | None = None,
    progress: bool = False,
    **config: Any,
) -> Any:
    """Join the group the launcher started; rank 0 gets the LLM, others ``None``.

    ``model`` overrides the config file's; with neither, the embedded default.
    """
    world = int(os.environ["WORLD_SIZE"])
    asked = config.pop("tensor_parallel_size", None)
    if asked not in (None, world):
        raise ConfigError(f"tensor_parallel_size={asked} but the launcher started {world} ranks")
    cfg = EngineConfig.load(
        config_file, model=model, tensor_parallel_size=world,
        distributed_executor="torchrun", **config,
    )
    timeout = datetime.timedelta(seconds=cfg.parallel.distributed_timeout_s)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    # torchrun keeps its store across restarts of the job: scope our keys (failure
    # reports among them) to this attempt.
    store = dist.PrefixStore(f"kvrunner/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}/", store)
    return join_group(
        cfg, store=store, rank=rank, world=world,
        local_rank=int(os.environ.get("LOCAL_RANK", rank)), progress=progress,
    )


def join_group(
    cfg: EngineConfig,
    *,
    store: dist.Store,
    rank: int,
    world: int,
    local_rank: int,
    progress: bool = False,
) -> Any:
    """This rank's part of a group whose ranks were started by some launcher
    (torchrun, Ray actors) and meet through ``store``: rank 0 gets the LLM, others
    serve rank 0's commands until it shuts down and get ``None``.

    ``cfg`` is every rank's same config, with ``tensor_parallel_size == world``;
    ``local_rank`` picks the CUDA device on this host (ignored on the CPU). A rank
    > 0 that fails reports it for rank 0 and ends its process (see
    :func:`_leave_cleanly`).
    """
    from kvrunner.llm import LLM
    from kvrunner.runner.ranks.broadcast_executor import (
        BroadcastExecutor,
        handed_to_rank_0,
        serve_broadcast,
    )
    from kvrunner.runner.ranks.worker import RankWorker, rank_device

    device = rank_device(cfg.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = DistGroup.init(
        rank=rank, size=world, device=device, backend=cfg.parallel.distributed_backend,
        timeout_s=cfg.parallel.distributed_timeout_s, store=store,
    )
    channel = BroadcastChannel(group)
    try:
        worker = RankWorker(cfg, group, progress=progress, faults=FaultPlan.from_env())
    except Exception as e:
        if rank == 0:
            channel.report_failure(RankFailure.from_exception(rank, e))
            raise
        handed_to_rank_0(channel, rank, e)
        _leave_cleanly()
    except BaseException as e:
        channel.report_failure(RankFailure.from_exception(rank, e))
        raise
    if rank == 0:
        return LLM.from_executor(cfg, BroadcastExecutor(worker, channel))
    if not serve_broadcast(worker, channel):
        _leave_cleanly()
    group.destroy()
    return None


def _leave_cleanly() -> NoReturn:
    """End a failed rank > 0 now, exit status 0, its error already printed and reported.

    Its sockets close with the process, which fails rank 0's pending collective, and
    rank 0 raises the error. A normal interpreter exit could abort instead: the
    process group, still held by the model's layers, is torn down by C++ destructors
    while its threads are live ("terminate called without an active exception"),
    and a non-zero status makes torchrun kill rank 0 before it names this rank.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """Generate for the given prompts; rank 0 prints one JSON line per prompt."""
    from kvrunner.sampling_params import SamplingParams

    p = argparse.ArgumentParser(prog="python -m kvrunner.launch", description=__doc__)
    p.add_argument("--model", default=None,
                   help="checkpoint directory or embedded default (default: the config "
                   "file's, else tiny-qwen3)")
    p.add_argument("--config-file")
    p.add_argument("--prompt", action="append", default=[], help="text prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[],
                   help="comma-separated token ids (repeatable)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--distributed-timeout-s", type=float)
    args = p.parse_args(argv)
    prompts: list[Any] = list(args.prompt)
    prompts += [[int(t) for t in ids.split(",")] for ids in args.prompt_ids]
    llm = launch(
        args.model, config_file=args.config_file,
        enforce_eager=args.enforce_eager or None, max_num_seqs=args.max_num_seqs,
        distributed_timeout_s=args.distributed_timeout_s,
    )
    if llm is None:
        return 0
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                ignore_eos=args.ignore_eos)
        for out in llm.generate(prompts, params):
            print(json.dumps({"prompt_token_ids": out.prompt_token_ids,
                              "token_ids": out.token_ids, "text": out.text}), flush=True)
    finally:
        llm.shutdown()  # releases the other ranks and leaves the group
    return 0


if __name__ == "__main__":
    sys.exit(main())
