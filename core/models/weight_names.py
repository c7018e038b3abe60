"""Checkpoint tensor names -> a model's (possibly fused, sharded) parameters.

A model's parameters rarely carry the checkpoint's names one for one: q/k/v and
gate/up projections are fused (``stacked``), experts are stacked into one tensor per
layer (``checkpoint_shards``, ``checkpoint_aliases`` on the parameter), and each rank
holds its shard. :func:`expected_weight_names` lists every checkpoint name a model
loads and where it goes; :func:`load_weights_into` streams tensors there through
each parameter's ``weight_loader``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from kvrunner.layers.weight_copy import copy_weight_
from kvrunner.models.kv_scale_names import OptionalWeight


def _default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    copy_weight_(param, loaded)


class WeightNameError(ValueError):
    """A pushed tensor's name is not a parameter of this model (the message names it).

    :ivar tensor: the checkpoint name at fault.
    """

    def __init__(self, message: str, *, tensor: str) -> None:
        super().__init__(message)
        self.tensor = tensor


class WeightShapeError(ValueError):
    """A tensor does not fit its parameter (the message names both shapes).

    :ivar tensor: the checkpoint name at fault.
    """

    def __init__(self, message: str, *, tensor: str) -> None:
        super().__init__(message)
        self.tensor = tensor


class WeightDuplicateError(ValueError):
    """One update names a tensor twice (or a stacked tensor and one it stands for).

    :ivar tensor: the checkpoint name given twice.
    """

    def __init__(self, message: str, *, tensor: str) -> None:
        super().__init__(message)
        self.tensor = tensor


class WeightScaleError(ValueError):
    """An update known up front gives an FP8 tensor for an FP8 weight without that
    weight's block scales: its bytes mean nothing without them.

    :ivar tensor: the FP8 tensor's checkpoint name; :ivar scale: the scales' name.
    """

    def __init__(self, message: str, *, tensor: str, scale: str) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.scale = scale


class WeightSetError(ValueError):
    """A whole checkpoint lacks tensors the model needs or holds ones it has no place for.

    :ivar missing: expected names no tensor was given for (sorted).
    :ivar unexpected: given names the model has no parameter for (sorted).
    """

    def __init__(self, message: str, *, missing: list[str], unexpected: list[str]) -> None:
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected


def expected_weight_names(
    module: nn.Module, stacked: Sequence[tuple[str, str, str | int]] = (),
    *, named: Sequence[tuple[str, nn.Parameter]] | None = None,
) -> dict[str, tuple[str, Any]]:
    """Checkpoint name -> ``(parameter name, shard id)`` for every tensor ``module`` loads.

    :param stacked: ``(fused_fragment, checkpoint_fragment, shard_id)``: a parameter
        whose name contains ``fused_fragment`` is filled from the checkpoint tensors
        named with ``checkpoint_fragment`` instead, each into its ``shard_id`` slice.

    A parameter may also carry ``checkpoint_shards``, ``{name relative to its module:
    shard id}``: it is filled from exactly those tensors (the stacked experts of a
    mixture-of-experts layer, one checkpoint tensor per expert and projection).

    :param named: ``module.named_parameters()`` already listed (a caller that needs
        them too walks the module once).
    """
    expected: dict[str, tuple[str, Any]] = {}
    for pname, param in module.named_parameters() if named is None else named:
        shards = getattr(param, "checkpoint_shards", None)
        if shards is not None:
            prefix = pname.rpartition(".")[0]
            for suffix, shard in shards.items():
                expected[f"{prefix}.{suffix}" if prefix else suffix] = (pname, shard)
            continue
        fused = [(f, c, s) for f, c, s in stacked if f in pname]
        for fragment, ckpt_fragment, shard in fused:
            expected[pname.replace(fragment, ckpt_fragment)] = (pname, shard)
        if not fused:
            expected[pname] = (pname, None)
    return expected


def alias_weight_names(
    module: nn.Module, *, named: Sequence[tuple[str, nn.Parameter]] | None = None
) -> dict[str, tuple[str, Any, list[str]]]:
    """Alternative name -> ``(parameter name, shard id, expected names it stands for)``.

    A parameter's ``checkpoint_aliases``, ``{name relative to its module: (shard id,
    [expected names relative to its module])}``, lets one tensor stand for several
    expected ones: transformers 5 holds a mixture-of-experts layer's experts stacked
    (``mlp.experts.gate_up_proj``), and a trainer built on it pushes them so.
    """
    aliases: dict[str, tuple[str, Any, list[str]]] = {}
    for pname, param in module.named_parameters() if named is None else named:
        prefix = pname.rpartition(".")[0]
        for suffix, (shard, covers) in getattr(param, "checkpoint_aliases", {}).items():
            aliases[f"{prefix}.{suffix}"] = (pname, shard, [f"{prefix}.{c}" for c in covers])
    return aliases


def optional_weight_names(module: nn.Module) -> dict[str, OptionalWeight]:
    """Name -> :class:`OptionalWeight` for every tensor a checkpoint may carry beyond
    the parameters: each submodule's ``optional_weights()`` (relative names), such as an
    attention layer's FP8 KV-cache scales (:mod:`kvrunner.models.kv_scale_names`). Its
    ``covers`` come back as full names."""
    found: dict[str, OptionalWeight] = {}
    for mname, mod in module.named_modules():
        optional = getattr(mod, "optional_weights", None)
        if optional is None:
            continue
        prefix = f"{mname}." if mname else ""
        for rel, weight in optional().items():
            found[prefix + rel] = attrs.evolve(weight,
                                               covers=tuple(prefix + c for c in weight.covers))
    return found


class WeightTargets:
    """Where every checkpoint name of a module loads, from one walk of its parameters:
    the parameters by name, :func:`expected_weight_names`, :func:`alias_weight_names`
    and :func:`optional_weight_names`. Walking a deep module costs about a millisecond
    of host time, so a push arriving in buckets builds this once for all of them; it
    stays right while the module keeps its parameter objects (a weight update never
    replaces them)."""

    def __init__(self, module: nn.Module, stacked: Sequence[tuple[str, str, str | int]] = ()):
        named = list(module.named_parameters())
        #: parameter name -> parameter
        self.params: dict[str, nn.Parameter] = dict(named)
        #: checkpoint name -> (parameter name, shard id)
        self.expected = expected_weight_names(module, stacked, named=named)
        #: alternative name -> (parameter name, shard id, expected names it stands for)
        self.aliases = alias_weight_names(module, named=named)
        #: names a checkpoint may carry beyond the parameters -> how they load
        self.optional = optional_weight_names(module)
        self._shadows: dict[str, nn.Parameter] | None = None

    @property
    def shadows(self) -> dict[str, nn.Parameter]:
        """Every parameter as a meta-device twin (its shape and dtype, no storage, its
        ``weight_loader``): what a dry run loads into, copying nothing."""
        if self._shadows is None:
            self._shadows = {}
            for pname, param in self.params.items():
                twin = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False)
                twin.weight_loader = getattr(param, "weight_loader", _default_weight_loader)
                self._shadows[pname] = twin
        return self._shadows


def load_weights_into(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    stacked: Sequence[tuple[str, str, str | int]] = (),
    ignore: Sequence[str] = (),
    require_all: bool = True,
    loaded: set[str] | None = None,
    targets: WeightTargets | None = None,
    dry_run: bool = False,
) -> set[str]:
    """Copy checkpoint tensors into ``module``'s parameters by name; returns the names
    loaded (ignored names excluded).

    Each tensor goes through its parameter's ``weight_loader`` (which takes this
    rank's shard of a full tensor and casts it to the parameter's dtype and device).

    :param stacked: see :func:`expected_weight_names`; a name from
        :func:`alias_weight_names` loads too, and counts as the names it stands for; a
        name from :func:`optional_weight_names` loads by its own rule, never required.
    :param ignore: checkpoint names containing any of these are skipped.
    :param require_all: a whole checkpoint: raise ``ValueError`` listing every
        expected tensor it lacks and every tensor the model has no place for, after
        loading all the others. ``False`` (a partial update, as a trainer streams
        them): a name the model does not have raises :class:`WeightNameError` at once.
    :param loaded: filled with each name as it loads (the returned set), so a caller
        still knows what was loaded when a later tensor raises.
    :param targets: ``module``'s :class:`WeightTargets` for ``stacked``, built once by
        a caller loading several parts of one update (else built here).
    :param dry_run: check a whole update without loading it: ``weights`` are usually
        meta-device tensors of the update's shapes, each goes through its parameter's
        own ``weight_loader`` into the parameter's meta twin (``WeightTargets.shadows``),
        so every name and shape is judged by the rule a real load applies, and a name
        given twice raises :class:`WeightDuplicateError`, and an FP8 tensor for an FP8
        weight whose block scales the update does not hold raises
        :class:`WeightScaleError`. Nothing is copied.
    :raises WeightShapeError: naming the tensor whose shape does not fit.
    :raises WeightSetError: ``require_all`` and the names do not match.
    """
    targets = targets or WeightTargets(module, stacked)
    expected, aliases = targets.expected, targets.aliases
    params = targets.shadows if dry_run else targets.params
    seen: set[str] = set() if loaded is None else loaded
    unexpected: list[str] = []
    #: an FP8 tensor's scales' name -> the tensor's (a dry run: they must come together)
    fp8_scales: dict[str, str] = {}
    for name, tensor in weights:
        target, covers = expected.get(name), [name]
        if target is None and name in aliases:
            pname, shard, covers = aliases[name]
            target = (pname, shard)
        if target is None and name in targets.optional:
            _load_optional(name, tensor, targets.optional[name], seen, dry_run)
            continue
        if target is None:
            if any(frag in name for frag in ignore):
                continue
            if not require_all:
                raise WeightNameError(
                    f"{type(module).__name__} has no parameter {name!r} (Hugging Face names "
                    f"expected, e.g. {_listing(sorted(expected), 3)})",
                    tensor=name,
                )
            unexpected.append(name)
            continue
        pname, shard = target
        if dry_run and not seen.isdisjoint(covers):
            twice = sorted(seen.intersection(covers))[0]
            raise WeightDuplicateError(
                f"tensor {twice!r} is given twice in one update"
                + (f" (also through {name!r})" if name != twice else ""), tensor=twice)
        scales = _scales_covered(name, pname, targets.params[pname], tensor)
        if scales is not None:
            covers = [*covers, scales[0]]
        scale_name = _scales_needed(name, targets.params[pname], tensor)
        if dry_run and scale_name is not None:
            fp8_scales[scale_name] = name
        if not dry_run:
            # where each loaded name went, and its full shape (what weights_checksum reads)
            layout = module.__dict__.setdefault("checkpoint_layout", {})
            layout[name] = (pname, shard, tuple(tensor.shape))
            if scales is not None:
                layout[scales[0]] = (scales[1], shard, scales[2])
        param = params[pname]
        loader = getattr(param, "weight_loader", _default_weight_loader)
        try:
            loader(param, tensor, shard)
        except ValueError as e:
            raise WeightShapeError(f"checkpoint tensor {name!r}: {e}", tensor=name) from e
        seen.update(covers)
    lacking = sorted(scale for scale in fp8_scales if scale not in seen)
    if lacking:
        tensor_name = fp8_scales[lacking[0]]
        raise WeightScaleError(
            f"FP8 tensor {tensor_name!r} comes without its block scales {lacking[0]!r} in "
            f"the same update: the FP8 bytes mean nothing without them (give both, or the "
            f"float tensor, which is quantized as it loads)"
            + (f"; {len(lacking) - 1} more FP8 tensor(s) lack theirs" if len(lacking) > 1
               else ""), tensor=tensor_name, scale=lacking[0])
    missing = sorted(set(expected) - seen) if require_all else []
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing {len(missing)}: {_listing(missing)}")
        if unexpected:
            problems.append(f"unexpected {len(unexpected)}: {_listing(sorted(unexpected))}")
        raise WeightSetError(
            f"{type(module).__name__} weights do not match: " + "; ".join(problems),
            missing=missing, unexpected=sorted(unexpected),
        )
    return seen


def _load_optional(name: str, tensor: torch.Tensor, weight: OptionalWeight, seen: set[str],
                   dry_run: bool) -> None:
    """Load (or, in a dry run, judge) one optional tensor; ``seen`` gets its name and the
    names it covers."""
    if dry_run and not seen.isdisjoint(weight.covers):
        twice = sorted(seen.intersection(weight.covers))[0]
        raise WeightDuplicateError(f"tensor {twice!r} is given twice in one update"
                                   + (f" (also through {name!r})" if name != twice else ""),
                                   tensor=twice)
    try:
        (weight.check if dry_run else weight.load)(tensor)
    except ValueError as e:
        raise WeightShapeError(f"checkpoint tensor {name!r}: {e}", tensor=name) from e
    seen.update((name, *weight.covers))


def _scales_covered(name: str, pname: str, param: nn.Parameter, tensor: torch.Tensor
                    ) -> tuple[str, str, tuple[int, ...]] | None:
    """For a float tensor loading into an FP8 weight (which quantizes it and writes its
    block scales too): ``(the scales' checkpoint name, their parameter, their full
    shape)``, so the scales count as given and the checksum digests them; else None.

    The weight names its scales' parameter beside it (``fp8_scale_name``: a linear's
    ``weight_scale_inv``, the stacked experts' ``w13_scale_inv``); the checkpoint names
    them ``...weight_scale_inv`` beside ``...weight``."""
    scale_param = getattr(param, "fp8_scale_name", None)
    if scale_param is None or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or (
            not name.endswith(".weight")):
        return None
    from kvrunner.layers.fp8.blocks import scale_shape
    from kvrunner.layers.fp8.weights import SCALE_SUFFIX

    prefix = pname.rpartition(".")[0]
    return (name.removesuffix("weight") + SCALE_SUFFIX,
            f"{prefix}.{scale_param}" if prefix else scale_param,
            scale_shape(tuple(tensor.shape)))


def _scales_needed(name: str, param: nn.Parameter, tensor: torch.Tensor) -> str | None:
    """For an FP8 tensor loading into an FP8 weight (its bytes placed as stored): the
    checkpoint name of the block scales it needs beside it; else None."""
    if getattr(param, "fp8_scale_name", None) is None or tensor.dtype not in (
            torch.float8_e4m3fn, torch.float8_e5m2) or not name.endswith(".weight"):
        return None
    from kvrunner.layers.fp8.weights import SCALE_SUFFIX

    # the checkpoint's name (a linear's and an expert's alike), not the parameter's
    return name.removesuffix("weight") + SCALE_SUFFIX


def _listing(names: list[str], limit: int = 12) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
