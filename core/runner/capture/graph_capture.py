"""A rank's decode graphs: captured (blanked, audited) at start-up and after a wake,
dropped at a sleep, and picked for each decode step.

:class:`GraphCapture` owns the graphs, the time their last capture took, and whether
a capture ran before (a recapture skips the warmup forwards). What a graph runs is
the step launcher's (:meth:`~kvrunner.runner.step_launch.StepLauncher.decode_outputs`);
where it ends (hidden states, logits, or tokens) is ``graph_end``, fixed by the
config.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvrunner.config import CaptureConfig
from kvrunner.engine.step_io import StepInput
from kvrunner.plugin_api.step_data import ForwardContext
from kvrunner.plugin_host.backend_manager import BackendManager
from kvrunner.runner.capture.capture import capture_decode_graphs
from kvrunner.runner.capture.graph_sampling import DecodeOutputs
from kvrunner.runner.capture.graphs import DecodeGraph, default_capture_sizes
from kvrunner.runner.step.forward_vars import ForwardVars
from kvrunner.runner.step.step_metadata import StepMetadataBuilder

#: what a decode graph runs: the forward of ``num_rows`` rows and what follows it
DecodeForward = Callable[[int, ForwardContext], DecodeOutputs]


class GraphCapture:
    """One decode graph per capture size, over the runner's persistent buffers."""

    def __init__(
        self,
        config: CaptureConfig,
        *,
        max_batch: int,
        backends: BackendManager,
        forward_vars: ForwardVars,
        step_builder: StepMetadataBuilder,
        device: torch.device,
        vocab_size: int,
    ) -> None:
        self.config = config
        self.max_batch = max_batch
        self.backends = backends
        self.forward_vars = forward_vars
        self.step_builder = step_builder
        self.device = device
        self.vocab_size = vocab_size
        self.graphs: dict[int, DecodeGraph] = {}
        #: where the decode graphs end (graph_sampling.py)
        self.graph_end = config.decode_graph_ends_at
        self.capture_seconds = 0.0
        self._captured_before = False  # a recapture skips the warmup forwards

    def sizes(self) -> list[int]:
        sizes = self.config.capture_sizes or default_capture_sizes(self.max_batch)
        return [s for s in sizes if s <= self.max_batch]

    def graph_for(self, step: StepInput) -> DecodeGraph | None:
        """The smallest graph a decode step fits; None for any other step."""
        if not self.graphs or not step.is_decode:
            return None
        fitting = [bs for bs in self.graphs if bs >= step.num_seqs]
        return self.graphs[min(fitting)] if fitting else None

    def capture(
        self, forward: DecodeForward, *, pools: dict, index_bound: int, progress: bool
    ) -> float:
        """(Re)capture every decode graph, blanked; returns seconds.

        :param pools: the cache pools the audit checks are left unchanged.
        :param index_bound: an index valid as a KV block, a KV slot and a state slot.
        """
        self.graphs = {}
        with torch.inference_mode():
            self.graphs, self.capture_seconds = capture_decode_graphs(
                sizes=self.sizes(),
                backends=self.backends,
                forward=forward,
                forward_vars=self.forward_vars,
                step_builder=self.step_builder,
                pools=pools,
                config=self.config,
                device=self.device,
                index_bound=index_bound,
                vocab_size=self.vocab_size,
                warmup=not self._captured_before,
                progress=progress,
            )
        self._captured_before = True
        return self.capture_seconds

    def drop(self) -> None:
        """Forget every graph (a sleep): their memory pool goes with them."""
        self.graphs = {}
