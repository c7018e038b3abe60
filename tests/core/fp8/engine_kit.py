"""What the FP8 engine tests (dense and experts) look at: greedy answers, the stored
FP8 bytes and scales, and where the parameters live; and the two GPU checks both run
(logprobs and greedy tokens within rounding of bf16, pushes and sleep with graphs
captured)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kvrunner import LLM, SamplingParams
from kvrunner.models.loader import iter_safetensors
from kvrunner.models.tiny import write_tiny_checkpoint

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


def answers(llm: LLM) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs."""
    return [(o.token_ids, list(o.logprobs)) for o in llm.generate(PROMPTS, GREEDY)]


def fp8_state(llm: LLM) -> dict[str, torch.Tensor]:
    """Every FP8 weight's bytes and every scale (a linear's ``weight_scale_inv``, the
    experts' ``w13_scale_inv`` / ``w2_scale_inv``), by parameter name."""
    return {n: (p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p).clone()
            for n, p in llm.runner.model.named_parameters()
            if p.dtype == torch.float8_e4m3fn or n.endswith("scale_inv")}


def pointers(llm: LLM) -> dict[str, int]:
    """Each parameter's storage address (a push must rewrite, not replace)."""
    return {n: p.data_ptr() for n, p in llm.runner.model.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rounded_to_fp8(path: Path, out: Path) -> Path:
    """A copy of checkpoint ``path`` whose projections (every ``*proj.weight``: what
    the FP8 engine quantizes) hold their FP8 block rounding, dequantized to bf16."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kvrunner.layers.fp8.blocks import dequantize_blocks, quantize_blocks

    out.mkdir(parents=True)
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    for f in path.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if name.endswith("proj.weight"):
                tensors[name] = dequantize_blocks(*quantize_blocks(t.cuda())).to(t.dtype).cpu()
        save_file(tensors, str(out / f.name))
    return out


def stays_within_rounding_of_bf16(path: Path, vocab: int,
                                  check_fp8: Callable[[LLM], None] | None = None) -> None:
    """64 random 200-token prompts, each token rescored (prompt logprobs) and the first
    greedy token after each: an FP8 engine on ``path`` against the bf16 one, beside a
    bf16 engine on the weights rounded to FP8 (``check_fp8`` looks at the FP8 engine
    first).

    The rounding of the weights to e4m3 blocks is the format's own loss. The FP8
    engine adds one more of the same kind where its product is w8a8 (every prefill
    chunk here): the activations' rounding to e4m3 per 1 x 128 group, independent of
    the weights' and of the same relative size, so its logprob errors add to the
    weights' in quadrature, about sqrt(2) times rounding's alone. The bounds:

    * the mean |logprob - bf16's| over the 12,800 prompt tokens is at most twice the
      rounded weights' (a wrong scale, tile or group moves it far past that);
    * the first greedy tokens agree with bf16's on at least 85% of the prompts (a
      random checkpoint's top two logits are close, so even the rounding alone moves
      some), and lose at most twice the rounding's disagreements, plus one."""
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(1, vocab, (64, 200), generator=g).tolist()
    score = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    firsts: dict[str, list[int]] = {}
    scored: dict[str, torch.Tensor] = {}
    rounded = path.parent / (path.name + "-rounded")
    for label, where, config in (("bf16", path, {}), ("fp8", path, {"quantization": "fp8"}),
                                 ("rounded", rounded, {})):
        if label == "rounded":
            rounded_to_fp8(path, rounded)
        with LLM(model=str(where), dtype="bfloat16", max_num_seqs=64, max_model_len=256,
                 gpu_memory_utilization=0.5, skip_tokenizer_init=True, **config) as llm:
            if label == "fp8" and check_fp8 is not None:
                check_fp8(llm)
            outs = llm.generate(prompts, score)
        firsts[label] = [o.token_ids[0] for o in outs]
        scored[label] = torch.tensor([lp for o in outs for lp in o.prompt_logprobs[1:]],
                                     dtype=torch.float64)

    gap = {e: (scored[e] - scored["bf16"]).abs().mean().item() for e in ("fp8", "rounded")}
    flips = {e: sum(x != y for x, y in zip(firsts[e], firsts["bf16"], strict=True))
             for e in ("fp8", "rounded")}
    found = (f"mean |logprob - bf16's| over {scored['bf16'].numel()} prompt tokens: FP8 engine "
             f"{gap['fp8']:.3e}, rounded weights {gap['rounded']:.3e} "
             f"({gap['fp8'] / gap['rounded']:.2f}x); first tokens unlike bf16's: FP8 engine "
             f"{flips['fp8']}, rounded weights {flips['rounded']} of {len(prompts)}")
    print(found)
    assert gap["fp8"] <= 2 * gap["rounded"], found
    assert flips["fp8"] <= min(0.15 * len(prompts), 2 * flips["rounded"] + 1), found


def pushes_and_sleep_serve_the_pushed_weights(tmp_path: Path, kind: str) -> None:
    """With graphs captured, a bf16 push into an FP8 engine rewrites the same storages
    and serves the pushed checkpoint's tokens; so does a push after a sleep that
    discarded the weights."""
    a = write_tiny_checkpoint(tmp_path / "a", kind=kind, seed=0)
    b = write_tiny_checkpoint(tmp_path / "b", kind=kind, seed=1)
    settings = dict(dtype="bfloat16", max_num_seqs=4, max_model_len=128,
                    gpu_memory_utilization=0.3, quantization="fp8")
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    with LLM(model=str(b), **settings) as ref:
        expected = [o.token_ids for o in ref.generate(prompts, greedy)]
    push = {n: t.cuda() for n, t in iter_safetensors(b, torch.bfloat16)}
    with LLM(model=str(a), **settings) as llm:
        llm.generate(prompts, greedy)  # graphs captured and replayed
        before = pointers(llm)
        llm.update_weights(push)
        assert pointers(llm) == before
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
        llm.sleep(2, discard_weights=True)
        llm.wake_up(["weights"])
        llm.update_weights(push)
        llm.wake_up(["kv_cache"])
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
