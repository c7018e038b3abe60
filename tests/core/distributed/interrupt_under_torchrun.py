"""Run under ``torchrun --nproc-per-node 2``: rank 0 generates, then generates again
with a Ctrl-C landing just after a step was broadcast (before rank 0 launched its own
share), then once more; it prints one JSON line of what each call gave."""

from __future__ import annotations

import json
import signal
import sys

from kvrunner import SamplingParams
from kvrunner.launch import launch

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


def main() -> None:
    llm = launch(sys.argv[1], enforce_eager=True, max_num_seqs=2, max_model_len=64)
    if llm is None:  # ranks > 0 served until rank 0 shut down
        return
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(PROMPTS, params)]
    channel = llm.executor.channel
    send, sent = channel.send, 0

    def send_then_interrupt(command) -> None:
        nonlocal sent
        send(command)
        if command[0] == "step":
            sent += 1
            if sent == 4:
                signal.raise_signal(signal.SIGINT)

    channel.send = send_then_interrupt
    try:
        llm.generate(PROMPTS, params)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    channel.send = send
    again = [o.token_ids for o in llm.generate(PROMPTS, params)]
    llm.shutdown()
    print(json.dumps({"first": first, "interrupted": interrupted, "again": again}), flush=True)


if __name__ == "__main__":
    main()
