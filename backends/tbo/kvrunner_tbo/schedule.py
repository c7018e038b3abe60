"""Running the model's layers over the parts: layer ``i`` of part 0, then of part 1.

On the CPU the parts simply take turns, layer by layer, which gives the results of
the overlapped schedule exactly. On CUDA each part runs on a stream of its own;
part 1 waits, layer by layer, for part 0 to have finished the same layer (a
sequence cut in two reads in its second part the keys and state its first part
wrote there), so part 0 runs one layer ahead. While one part is in a tensor-parallel
all-reduce (on the communicator's stream) the other's matmuls and attention run.
The fork and join are stream waits, which a CUDA graph captures like any kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrunner.plugin_api import LayerStack, MicroBatch


def run_in_turns(
    stack: LayerStack, parts: Sequence[MicroBatch], input_ids: torch.Tensor
) -> torch.Tensor:
    """The parts one after the other within every layer, on the current stream."""
    hidden = [stack.embed(input_ids[p.tokens]) for p in parts]
    residual: list[torch.Tensor | None] = [None] * len(parts)
    for layer in stack.layers:
        for m, part in enumerate(parts):
            hidden[m], residual[m] = layer(part.step.positions, hidden[m], residual[m],
                                           part.context)
    return torch.cat([stack.norm(h, r) for h, r in zip(hidden, residual, strict=True)])


class StreamSchedule:
    """One CUDA stream per part, made once (a captured graph refers to them)."""

    def __init__(self, device: torch.device, parts: int = 2) -> None:
        self.device = device
        self.streams = [torch.cuda.Stream(device) for _ in range(parts)]

    def run(
        self, stack: LayerStack, parts: Sequence[MicroBatch], input_ids: torch.Tensor
    ) -> torch.Tensor:
        main = torch.cuda.current_stream(self.device)
        streams = self.streams[: len(parts)]
        # done[m][i]: part m finished layer i (its cache and state written)
        done = [[torch.cuda.Event() for _ in stack.layers] for _ in parts]
        hidden: list[torch.Tensor] = []
        residual: list[torch.Tensor | None] = [None] * len(parts)
        for stream, part in zip(streams, parts, strict=True):
            stream.wait_stream(main)  # the step's inputs and metadata were staged there
            with torch.cuda.stream(stream):
                hidden.append(stack.embed(input_ids[part.tokens]))
        for i, layer in enumerate(stack.layers):
            for m, (stream, part) in enumerate(zip(streams, parts, strict=True)):
                with torch.cuda.stream(stream):
                    if m > 0:
                        stream.wait_event(done[m - 1][i])
                    hidden[m], residual[m] = layer(part.step.positions, hidden[m], residual[m],
                                                   part.context)
                    done[m][i].record(stream)
        outputs = []
        for m, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                outputs.append(stack.norm(hidden[m], residual[m]))
        for stream in streams:
            main.wait_stream(stream)
        # Concatenated on the main stream: the parts' tensors are freed back to their
        # own streams' pools only after main has read them.
        return torch.cat(outputs)
