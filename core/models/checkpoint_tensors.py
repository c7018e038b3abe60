"""A checkpoint directory's tensors as a stream, and its faults named by file and tensor.

:class:`CheckpointTensors` yields every tensor of the weight files one at a time
(peak host memory is one tensor) and remembers which file each came from, so a
tensor the model refuses (wrong shape, no place for it) and a tensor the model
needs but no file holds are each reported as a
:class:`~kvrunner.errors.CheckpointError` naming the file (or, for a missing
tensor, the directory) and the tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvrunner.errors import CheckpointError
from kvrunner.models.checkpoint_files import check_weight_files
from kvrunner.models.weight_names import WeightNameError, WeightSetError, WeightShapeError

#: ``(name, tensor) -> problem`` (None when the tensor is fine), checked before it loads
TensorCheck = Callable[[str, torch.Tensor], "str | None"]


class CheckpointTensors:
    """An iterator over ``(name, tensor)`` of a checkpoint's weight files (the index's
    shards, or every ``*.safetensors``), floats cast to ``dtype``.

    Every file's header is checked when this is made, before any tensor is read: a
    truncated or corrupt file raises CheckpointError naming it, up front.

    :param check: run on each tensor as read; a problem it returns is raised as a
        CheckpointError naming the file and the tensor.
    """

    def __init__(self, path: Path, dtype: torch.dtype, check: TensorCheck | None = None) -> None:
        self.path = Path(path)
        self.files = check_weight_files(self.path)
        #: the file each tensor yielded so far came from
        self.file_of: dict[str, Path] = {}
        self._check = check
        self._stream = self._tensors(dtype)

    def __iter__(self) -> CheckpointTensors:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._stream)

    def _tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                        self.file_of[name] = file
                        tensor = f.get_tensor(name)
                        problem = self._check(name, tensor) if self._check else None
                        if problem is not None:
                            raise CheckpointError(file, f"tensor {name!r} {problem}")
                        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
            except (SafetensorError, OSError) as e:
                raise CheckpointError(file, f"cannot be read as safetensors: {e}") from None

    def error(self, error: ValueError) -> CheckpointError:
        """The CheckpointError for a model's refusal of these tensors, naming the file
        of the tensor at fault (the directory for a tensor no file holds)."""
        if isinstance(error, (WeightNameError, WeightShapeError)):
            file = self.file_of.get(error.tensor, self.path)
            return CheckpointError(file, str(error))
        if isinstance(error, WeightSetError) and error.unexpected:
            return CheckpointError(self.file_of.get(error.unexpected[0], self.path), str(error))
        if isinstance(error, WeightSetError):
            return CheckpointError(self.path, f"no weight file holds the tensor(s) the model "
                                              f"needs: {error}")
        return CheckpointError(self.path, str(error))
