"""A checkpoint directory's tensors as a stream, and its faults named by file and tensor.

:class:`CheckpointTensors` yields every tensor of the weight files one at a time
(peak host memory is one tensor) and remembers which file each came from, so a
tensor the model refuses (wrong shape, no place for it) and a tensor the model
needs but no file holds are each reported as a
:class:`~kvrunner.errors.CheckpointError` naming the file (or, for a missing
tensor, the directory) and the tensor.

:func:`load_checkpoint` is the one rule a checkpoint loads by, at start-up and in
``load_weights``: every tensor's name, shape and dtype is judged from the files'
headers (the ``safetensors`` library's ``get_slice``, no values read) against the
model before anything loads; with ``check_finite`` every value is checked for NaN
and inf, before the first tensor loads where old weights must survive a refusal
(one more read of every tensor), else as each is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kvrunner.errors import CheckpointError
from kvrunner.models.checkpoint_files import check_weight_files
from kvrunner.models.kv_scale_names import is_kv_scale_name
from kvrunner.models.tensor_checks import tensor_problem
from kvrunner.models.weight_names import (
    WeightDuplicateError,
    WeightNameError,
    WeightScaleError,
    WeightSetError,
    WeightShapeError,
)
from kvrunner.models.weight_specs import TensorSpec, check_specs

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
        #: run on each tensor as it is read (see the class docstring)
        self.check = check
        self._stream = self._tensors(dtype)

    def __iter__(self) -> CheckpointTensors:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._stream)

    def specs(self) -> list[TensorSpec]:
        """Every tensor's name, shape and dtype from the files' headers (no value is
        read), each file noted in :attr:`file_of`; a tensor held by two files, or of a
        dtype no parameter takes (an integer, a bool), is a CheckpointError naming it."""
        specs: list[TensorSpec] = []
        for file in self.files:
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                        if name in self.file_of:
                            raise CheckpointError(file, f"holds tensor {name!r}, which "
                                                        f"{self.file_of[name].name} holds too")
                        self.file_of[name] = file
                        part = f.get_slice(name)
                        spec = TensorSpec(name, tuple(part.get_shape()), part.get_dtype(),
                                          _is_float(part.get_dtype()))
                        if spec.problem() is not None:
                            raise CheckpointError(file, f"tensor {name!r} {spec.problem()}")
                        specs.append(spec)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(file, f"cannot be read as safetensors: {e}") from None
        return specs

    def check_values(self) -> None:
        """Read every tensor once (one at a time) and refuse one holding NaN or inf,
        naming its file; nothing is kept."""
        for file in self.files:
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                        problem = tensor_problem(f.get_tensor(name), check_finite=True)
                        if problem is not None:
                            raise CheckpointError(file, f"tensor {name!r} {problem}")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(file, f"cannot be read as safetensors: {e}") from None

    def _tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                        self.file_of[name] = file
                        tensor = f.get_tensor(name)
                        problem = self.check(name, tensor) if self.check else None
                        if problem is not None:
                            raise CheckpointError(file, f"tensor {name!r} {problem}")
                        yield name, _cast(name, tensor, dtype)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(file, f"cannot be read as safetensors: {e}") from None

    def error(self, error: ValueError) -> CheckpointError:
        """The CheckpointError for a model's refusal of these tensors, naming the file
        of the tensor at fault (the directory for a tensor no file holds)."""
        if isinstance(error, (WeightNameError, WeightShapeError, WeightDuplicateError,
                              WeightScaleError)):
            file = self.file_of.get(error.tensor, self.path)
            return CheckpointError(file, str(error))
        if isinstance(error, WeightSetError) and error.unexpected:
            return CheckpointError(self.file_of.get(error.unexpected[0], self.path), str(error))
        if isinstance(error, WeightSetError):
            return CheckpointError(self.path, f"no weight file holds the tensor(s) the model "
                                              f"needs: {error}")
        return CheckpointError(self.path, str(error))


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float tensor in ``dtype``; an FP8 checkpoint's bytes and their float32 block
    scales (``*_scale_inv``) stay as stored (only together do they mean anything), and
    so do KV-cache scales (rounded to bf16, a scale would move every key it stores)."""
    if (not tensor.is_floating_point() or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            or name.endswith("_scale_inv") or is_kv_scale_name(name)):
        return tensor
    return tensor.to(dtype)


def _is_float(header_dtype: str) -> bool:
    """Whether a safetensors header dtype (``F32``, ``BF16``, ``F8_E4M3``, ``I32``, ``BOOL``
    ...) is a floating-point one."""
    return header_dtype.startswith(("F", "BF"))


def load_checkpoint(
    model: Any, tensors: CheckpointTensors, *, check_finite: bool, values_first: bool,
    loaded: set[str] | None = None, progress: bool = False,
) -> set[str]:
    """Load checkpoint ``tensors`` into ``model`` by the one rule (see the module
    docstring); returns the names loaded.

    :param values_first: check every value before the first tensor loads (an update
        of weights that serve: a refusal leaves them untouched); else each as it is
        read (start-up: nothing to keep).
    :param loaded: filled with each name as it loads.
    :raises CheckpointError: naming the file and the tensor; with ``values_first``
        (or a fault in the headers) nothing was loaded.
    """
    specs = tensors.specs()
    try:
        check_specs(model, specs, whole=True)
    except ValueError as e:
        raise tensors.error(e) from None
    if check_finite and values_first:
        tensors.check_values()
    elif check_finite:
        tensors.check = lambda _, t: tensor_problem(t, check_finite=True)
    stream: Any = tensors
    if progress:
        from tqdm import tqdm

        stream = tqdm(tensors, desc="loading weights", unit="tensor")
    try:
        return model.load_weights(stream, loaded=loaded)
    except CheckpointError:  # the stream's own, naming its file already
        raise
    except ValueError as e:  # a tensor the model refuses: name its file
        raise tensors.error(e) from None
