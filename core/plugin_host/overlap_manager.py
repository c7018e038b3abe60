"""The overlap plugin of one runner (at most one), and the only caller of its hooks.

It is found in the same ``kvrunner.backends`` entry-point group as the layer
backends, but declares ``plugin_role = "overlap"`` and serves no layer type; the
config selects it with ``overlap = "<name>"`` on top of the layer backends. Every
failure raises :class:`~kvrunner.plugin_api.BackendError` naming the plugin and hook.
"""

from __future__ import annotations

from typing import Any

import pluggy
import torch

from kvrunner.plugin_api import hookspecs
from kvrunner.plugin_api.errors import BackendError, BackendHookError
from kvrunner.plugin_api.overlap import LayerBackends, LayerStack, MicroBatch, OverlapContext
from kvrunner.plugin_api.step_data import CacheWriteTarget, StepMetadata
from kvrunner.plugin_host.plugins import discover_backends
from kvrunner.plugin_host.write_targets import require_fixed_names, validate_write_targets

#: the value of ``plugin_role`` an overlap plugin's factory declares
OVERLAP_ROLE = "overlap"


class OverlapPlugin:
    """One overlap plugin, registered on a plugin manager of its own."""

    def __init__(self, context: OverlapContext) -> None:
        self.name = context.name
        available = discover_backends()
        if self.name not in available:
            raise BackendError(
                f"overlap plugin {self.name!r} is not installed; installed plugins: "
                f"{sorted(available) or 'none'}"
            )
        factory = available[self.name].load()
        if getattr(factory, "plugin_role", "layers") != OVERLAP_ROLE:
            raise BackendError(
                f"{self.name!r} is a layer backend, not an overlap plugin (its factory does "
                f"not declare plugin_role = {OVERLAP_ROLE!r})"
            )
        self.pm = pluggy.PluginManager("kvrunner")
        self.pm.add_hookspecs(hookspecs)
        try:
            self.pm.register(factory(context), name=self.name)
            self.pm.check_pending()
        except Exception as e:
            raise BackendError(f"overlap plugin {self.name!r} failed to load: {e}") from e
        self._target_names: dict[str, frozenset[str]] = {}

    def _call(self, hook: str, **kwargs: Any) -> Any:
        try:
            answer = getattr(self.pm.hook, hook)(**kwargs)
        except BackendError:
            raise
        except Exception as e:
            raise BackendHookError(
                f"overlap plugin {self.name!r}: hook {hook} failed: {e!r}"
            ) from e
        return answer[0] if answer else None

    def buffers(
        self, layer_write_targets: list[CacheWriteTarget], *, max_batch: int, max_tokens: int
    ) -> dict[str, torch.Tensor]:
        """The plugin's persistent buffers as ``"<plugin>.<name>"``."""
        named = self._call(
            "overlap_buffers", layer_write_targets=layer_write_targets,
            max_batch=max_batch, max_tokens=max_tokens,
        ) or {}
        return {f"{self.name}.{key}": tensor for key, tensor in named.items()}

    def plan(self, step: StepMetadata, layers: LayerBackends) -> tuple[MicroBatch, ...] | None:
        """The step's micro-batches, or ``None`` to run it whole."""
        parts = self._call("plan_micro_batches", step=step, layers=layers)
        if parts is None:
            return None
        covered = [row for part in parts for row in range(part.tokens.start, part.tokens.stop)]
        if covered != list(range(step.num_padded_tokens)):
            raise BackendError(
                f"overlap plugin {self.name!r}: its micro-batches cover token rows "
                f"{[(p.tokens.start, p.tokens.stop) for p in parts]}, not "
                f"0..{step.num_padded_tokens} exactly once in order"
            )
        return tuple(parts)

    def forward(
        self, stack: LayerStack, micro_batches: tuple[MicroBatch, ...], input_ids: torch.Tensor
    ) -> torch.Tensor:
        return self._call(
            "forward_micro_batches", stack=stack, micro_batches=micro_batches, input_ids=input_ids
        )

    def write_targets(self) -> list[CacheWriteTarget]:
        """The plugin's own write targets (its mirrors), validated; a fixed set."""
        targets = validate_write_targets(self.name, self._call("cache_write_targets") or [])
        require_fixed_names(self.name, targets, self._target_names)
        return targets
