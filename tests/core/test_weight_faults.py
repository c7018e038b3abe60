"""Weights in, checkpoint faults out: nothing a trainer or a checkpoint gets wrong is silent.

A mismatched checkpoint (wrong shape, missing tensor, unexpected tensor) is a
CheckpointError naming the file and the tensor, at start-up and through
``load_weights``. ``update_weights`` takes pairs or a Mapping, refuses a value that
is not a finite floating-point tensor naming it, and a push that failed part way is
repaired only by pushing every tensor it did not load. ``cache_info().weights``
says which of these the weights are in.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrunner import LLM, CheckpointError, SamplingParams
from kvrunner.errors import SleepStateError, WeightUpdateError
from kvrunner.models.loader import iter_safetensors
from kvrunner.models.tiny import write_tiny_checkpoint
from kvrunner.plugin_api import KvrunnerError

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SETTINGS = dict(
    max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4,
    capture_sizes=(1, 2, 4), cpu_cache_bytes=2 << 20,
)
VICTIM = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("weights")
    return write_tiny_checkpoint(root / "a", seed=0), write_tiny_checkpoint(root / "b", seed=1)


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[Path, list[list[int]]]:
    return {path: tokens(LLM(model=str(path), **SETTINGS)) for path in checkpoints}


def tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def altered(src: Path, dst: Path, change) -> Path:
    """A copy of checkpoint ``src`` whose tensors ``change`` edited (a dict, in place)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def wrong_shape(t: dict) -> None:
    t[VICTIM] = t[VICTIM][:, :-1].contiguous()


def missing(t: dict) -> None:
    del t[VICTIM]


def unexpected(t: dict) -> None:
    t["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)


def non_finite(t: dict) -> None:
    t[VICTIM] = t[VICTIM].clone()
    t[VICTIM][0, 0] = float("nan")


FAULTS = {
    "wrong shape": (wrong_shape, VICTIM),
    "missing": (missing, VICTIM),
    "unexpected": (unexpected, "model.layers.0.mlp.extra.weight"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_mismatched_checkpoint_at_start_is_a_checkpoint_error_naming_file_and_tensor(
    checkpoints, tmp_path, fault
) -> None:
    change, tensor = FAULTS[fault]
    bad = altered(checkpoints[0], tmp_path / "bad", change)
    with pytest.raises(CheckpointError, match=tensor.replace(".", r"\.")) as raised:
        LLM(model=str(bad), **SETTINGS)
    where = bad if fault == "missing" else bad / "model.safetensors"
    assert raised.value.path == where
    assert str(raised.value).startswith(str(where))


@pytest.mark.parametrize("fault", [*sorted(FAULTS), "non-finite"])
def test_load_weights_refuses_a_mismatched_checkpoint_naming_file_and_tensor(
    checkpoints, expected, tmp_path, fault
) -> None:
    change, tensor = FAULTS.get(fault, (non_finite, VICTIM))
    served, pushed = checkpoints
    bad = altered(pushed, tmp_path / "bad", change)
    llm = LLM(model=str(served), **SETTINGS)
    with pytest.raises(CheckpointError, match=tensor.replace(".", r"\.")) as raised:
        llm.load_weights(bad)
    assert raised.value.path in (bad, bad / "model.safetensors")
    llm.load_weights(pushed)  # a whole checkpoint repairs whatever the refusal left
    assert llm.cache_info().weights == "resident"
    assert tokens(llm) == expected[pushed]


def test_load_weights_check_finite_false_loads_a_nan_checkpoint(checkpoints, tmp_path) -> None:
    bad = altered(checkpoints[1], tmp_path / "nan", non_finite)
    llm = LLM(model=str(checkpoints[0]), **SETTINGS)
    assert llm.load_weights(bad, check_finite=False) > 0
    assert llm.cache_info().weights == "resident"


def test_a_state_dict_push_gives_the_tokens_of_a_pair_push(checkpoints, expected) -> None:
    served, pushed = checkpoints
    state_dict = dict(iter_safetensors(pushed, torch.float32))
    by_pairs = LLM(model=str(served), **SETTINGS)
    by_pairs.update_weights(iter(state_dict.items()))
    by_mapping = LLM(model=str(served), **SETTINGS)
    assert by_mapping.update_weights(state_dict) == len(state_dict)
    assert tokens(by_mapping) == tokens(by_pairs) == expected[pushed]


def test_any_floating_dtype_is_cast_to_the_model_dtype(checkpoints, expected) -> None:
    served, pushed = checkpoints
    llm = LLM(model=str(served), **SETTINGS)
    llm.update_weights({n: t.double() for n, t in iter_safetensors(pushed, torch.float32)})
    assert tokens(llm) == expected[pushed]


BAD_VALUES = {
    "a list": (lambda t: t.tolist(), "not a torch.Tensor"),
    "int": (lambda t: t.to(torch.int64), "int64"),
    "bool": (lambda t: t > 0, "bool"),
    "complex": (lambda t: t.to(torch.complex64), "complex64"),
    "nan": (lambda t: t.clone().index_fill_(0, torch.tensor([0]), float("nan")), "NaN or inf"),
    "inf": (lambda t: t.clone().index_fill_(0, torch.tensor([1]), float("inf")), "NaN or inf"),
}


@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
def test_a_bad_value_is_refused_naming_the_tensor_and_the_engine_keeps_serving(
    checkpoints, expected, kind
) -> None:
    served, pushed = checkpoints
    make, why = BAD_VALUES[kind]
    llm = LLM(model=str(served), **SETTINGS)
    value = make(dict(iter_safetensors(pushed, torch.float32))[VICTIM])
    with pytest.raises(WeightUpdateError, match=rf"{VICTIM.replace('.', '[.]')}.*{why}"):
        llm.update_weights([(VICTIM, value)])
    assert isinstance(WeightUpdateError("x"), KvrunnerError)
    assert llm.cache_info().weights == "resident"  # nothing of it was loaded
    assert tokens(llm) == expected[served]


def test_check_finite_false_lets_a_nan_tensor_through(checkpoints) -> None:
    llm = LLM(model=str(checkpoints[0]), **SETTINGS)
    nan = dict(iter_safetensors(checkpoints[1], torch.float32))[VICTIM] * float("nan")
    assert llm.update_weights([(VICTIM, nan)], check_finite=False) == 1


def test_a_failed_streamed_push_is_repaired_only_by_every_tensor_it_did_not_load(
    checkpoints, expected
) -> None:
    """A generator is streamed: the pairs drawn before the refused one loaded, so the
    weights are partial, the refusal says how to repair, and only pushing every
    tensor it did not load repairs them."""
    served, pushed = checkpoints
    llm = LLM(model=str(served), **SETTINGS)
    good = list(iter_safetensors(pushed, torch.float32))
    cut = len(good) // 2
    with pytest.raises(WeightUpdateError, match="NaN") as refused:
        llm.update_weights(iter([*good[:cut], (good[cut][0], good[cut][1] * float("nan"))]))
    assert f"{len(good) - cut} tensor(s) were not loaded" in str(refused.value)
    assert "load_weights(path)" in str(refused.value)
    assert llm.cache_info().weights == "partial"
    llm.update_weights(good[:1])  # one tensor is no repair
    with pytest.raises(SleepStateError, match=rf"{len(good) - cut} tensor\(s\)"):
        llm.generate(PROMPTS, GREEDY)
    assert llm.cache_info().weights == "partial"
    llm.update_weights(good[cut:-1])
    with pytest.raises(SleepStateError, match=good[-1][0].replace(".", r"\.")):
        llm.generate(PROMPTS, GREEDY)
    llm.update_weights(good[-1:])
    assert llm.cache_info().weights == "resident"
    assert tokens(llm) == expected[pushed]


def test_cache_info_says_discarded_until_every_tensor_is_pushed(checkpoints, expected) -> None:
    served, pushed = checkpoints
    llm = LLM(model=str(served), **SETTINGS)
    assert llm.cache_info().weights == "resident"
    llm.sleep(2, discard_weights=True)
    assert llm.cache_info().weights == "discarded"
    llm.wake_up()
    assert llm.cache_info().weights == "discarded"  # resident memory, undefined values
    good = list(iter_safetensors(pushed, torch.float32))
    llm.update_weights(good[:-1])
    assert llm.cache_info().weights == "discarded"
    llm.update_weights(good[-1:])
    assert llm.cache_info().weights == "resident"
    assert tokens(llm) == expected[pushed]


def test_the_cli_prints_a_mismatched_checkpoint_as_one_line(checkpoints, tmp_path, capsys) -> None:
    from kvrunner.cli.main import main

    bad = altered(checkpoints[0], tmp_path / "bad", wrong_shape)
    code = main(["generate", "hello", "--model", str(bad), "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert code != 0
    message = err.rpartition("kvrunner: error: ")[1:]  # after the loading progress bar
    message = "".join(message)
    assert message.count("\n") == 1 and "Traceback" not in err
    assert message.startswith("kvrunner: error: ")
    assert str(bad / "model.safetensors") in message and VICTIM in message


def test_a_generator_refilling_one_buffer_for_every_tensor_loads_each_value(
    checkpoints, expected
) -> None:
    """A generator is drawn one pair at a time, each loaded before the next is drawn
    (a trainer may gather every parameter into the same buffer)."""
    served, pushed = checkpoints
    llm = LLM(model=str(served), **SETTINGS)
    state_dict = dict(iter_safetensors(pushed, torch.float32))
    buffer = torch.empty(max(t.numel() for t in state_dict.values()))

    def refilled():
        for name, tensor in state_dict.items():
            view = buffer[: tensor.numel()].view(tensor.shape)
            view.copy_(tensor)
            yield name, view

    assert llm.update_weights(refilled()) == len(state_dict)
    assert tokens(llm) == expected[pushed]


def test_a_list_is_checked_in_one_pass_and_still_names_the_first_value_refused(
    checkpoints, expected
) -> None:
    """A list or Mapping is checked for NaN and inf in one pass over all of it; the
    first value refused in order is named (a wrong type before a NaN), values whose
    sum overflows but are each finite load, and nothing of a refused value loads."""
    served, pushed = checkpoints
    llm = LLM(model=str(served), **SETTINGS)
    good = list(iter_safetensors(pushed, torch.float32))
    nan = (good[3][0], good[3][1].clone().index_fill_(0, torch.tensor([0]), float("nan")))
    with pytest.raises(WeightUpdateError, match=rf"{good[1][0].replace('.', '[.]')}.*int64"):
        llm.update_weights([good[0], (good[1][0], good[1][1].long()), good[2], nan])
    with pytest.raises(WeightUpdateError, match=rf"{good[3][0].replace('.', '[.]')}.*NaN"):
        llm.update_weights(dict([*good[:3], nan, *good[4:]]))
    huge = (VICTIM, torch.full_like(dict(good)[VICTIM], 3e38))
    assert llm.update_weights([huge]) == 1  # the one pass overflows: each value is checked
    llm.update_weights(good)
    assert tokens(llm) == expected[pushed]


def integer_victim(t: dict) -> None:
    t[VICTIM] = t[VICTIM].to(torch.int32)


@pytest.mark.parametrize(("change", "why"), [
    (integer_victim, "has dtype I32; weights must be floating point"),
    (non_finite, "holds NaN or inf values"),
], ids=["int32", "NaN"])
def test_start_up_refuses_what_load_weights_refuses_naming_the_tensor(
    checkpoints, tmp_path, change, why
) -> None:
    """One loading rule: an integer tensor (which a cast would silently turn into
    other weights) and, with check_finite on by default, a NaN are refused at start."""
    bad = altered(checkpoints[0], tmp_path / "bad", change)
    with pytest.raises(CheckpointError, match=rf"{VICTIM.replace('.', '[.]')}' {why}") as info:
        LLM(model=str(bad), **SETTINGS)
    assert info.value.path == bad / "model.safetensors"


def test_check_finite_false_starts_on_a_nan_checkpoint(checkpoints, tmp_path) -> None:
    bad = altered(checkpoints[0], tmp_path / "nan", non_finite)
    with LLM(model=str(bad), check_finite=False, **SETTINGS) as llm:
        assert llm.cache_info().weights == "resident"


def test_generate_prints_why_a_request_ended_in_error_and_exits_non_zero(
    checkpoints, tmp_path, capsys
) -> None:
    from kvrunner.cli.main import main

    def nan_norm(t: dict) -> None:
        t["model.norm.weight"] = t["model.norm.weight"].clone()
        t["model.norm.weight"][0] = float("nan")

    bad = altered(checkpoints[0], tmp_path / "nan", nan_norm)
    code = main(["generate", "5,6,7", "--token-ids", "--model", str(bad), "--max-tokens", "2",
                 "--no-check-finite"])
    captured = capsys.readouterr()
    assert code == 1
    assert "-> error (step 1 (output token 0): logits hold NaN)" in captured.out
    assert captured.err.endswith(
        "kvrunner: error: 1 of 1 request(s) ended in error: step 1 (output token 0): logits "
        "hold NaN\n")
