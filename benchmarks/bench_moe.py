"""Mixture-of-experts on one GPU: the fused MoE layer, then end-to-end decode.

1. The layer at Qwen3-30B-A3B's shape (128 experts, top-8, hidden 2048, expert
   intermediate 768, bf16) at batch 1, 64 and 256: the fused block (router, top-k,
   alignment, grouped GEMMs, combine) replayed from a CUDA graph and eagerly,
   against the torch grouped reference (one matmul pair per used expert) and the
   HBM floor: the bytes of the experts the batch actually routes to, plus the router
   and the activations, over the measured copy bandwidth. With ``--fp8`` the same
   layer again with FP8 experts (e4m3, 128 x 128 block scales, quantized from the same
   bf16 weights; the w8a16 kernels), against the torch path on the dequantized weights
   and its own floor (one byte a weight, plus the scales).
2. Greedy decode of a random Qwen3-30B-A3B-shaped model (48 layers, 32 q / 4 kv
   heads of 128, vocab 151936; ~61 GB of bf16 weights) through kvrunner's captured
   graphs and through transformers ``generate`` in the same run, at batch 1, 64,
   256: ms per step, tokens/s, the ratio, and step time as a multiple of the floor
   (the expert bytes the step's routing touches, all other weights, the KV read).

The checkpoint directory holds only config.json and a tokenizer: both engines get
random weights generated on the GPU (61 GB would neither fit the disk nor be quick
to write), drawn so the routing is spread as a trained router's is.

    python benchmarks/bench_moe.py [--skip-hf] [--skip-e2e] [--layers N] [--fp8]
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from common import copy_bandwidth_tbps, median_ms, rel_err
from decode_timing import ours_step_ms, prompts

from kvrunner import LLM
from kvrunner.layers.fp8.choice import building_with
from kvrunner.layers.fp8.experts import dequantize_experts, quantize_experts
from kvrunner.layers.moe import SparseMoeBlock
from kvrunner.layers.moe_experts import grouped_experts_torch
from kvrunner.models import loader
from kvrunner.models.tiny import write_tiny_checkpoint

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
SHAPE = dict(layers=48, heads=32, kv_heads=4, head_dim=128, vocab=151936, dense_inter=6144)
BATCHES = (1, 64, 256)
PROMPT, NEW = 128, 128
BF16 = 2  # bytes


# -- 1. the layer -------------------------------------------------------------------------


def make_block(seed: int = 0, *, fp8: bool = False) -> SparseMoeBlock:
    """The layer with random weights (std 1/sqrt(fan-in)); ``fp8``: its experts FP8,
    quantized from the very bf16 weights the bf16 layer of the same seed holds."""
    with building_with("fp8" if fp8 else None):
        block = SparseMoeBlock(hidden_size=HIDDEN, num_experts=EXPERTS, top_k=TOP_K,
                               intermediate_size=INTER, renormalize=True, dtype=torch.bfloat16,
                               device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device="cuda") / shape[-1] ** 0.5).to(
            torch.bfloat16)

    e = block.experts
    with torch.no_grad():
        block.gate.weight.copy_(draw(tuple(block.gate.weight.shape)))
        w13, w2 = draw((EXPERTS, 2 * INTER, HIDDEN)), draw((EXPERTS, HIDDEN, INTER))
        if fp8:
            for param, value in zip((e.w13, e.w13_scale_inv, e.w2, e.w2_scale_inv),
                                    quantize_experts(w13, w2), strict=True):
                param.copy_(value)
        else:
            e.w13.copy_(w13)
            e.w2.copy_(w2)
    return block


def floor_us(ids: torch.Tensor, tokens: int, bw: float, weight_bytes: float = BF16) -> float:
    """Bytes the layer must move: each routed expert's weights once (``weight_bytes`` a
    weight: FP8's one byte plus its share of a float32 scale per 128 x 128 block), the
    router, x in, the output out."""
    used = int(torch.unique(ids).numel())
    nbytes = (used * 3 * HIDDEN * INTER * weight_bytes + EXPERTS * HIDDEN * BF16
              + 2 * tokens * HIDDEN * BF16)
    return nbytes / bw * 1e6


def graphed(block: SparseMoeBlock, x: torch.Tensor):
    """The block captured in a CUDA graph over a static input (as a decode step runs it)."""
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            block(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(static_x)
    return graph, out


def bench_layer(bw: float, *, fp8: bool = False) -> None:
    block = make_block(fp8=fp8)
    experts = block.experts
    weight_bytes = 1 + 4 / 128**2 if fp8 else BF16
    w13, w2 = (dequantize_experts(experts.w13, experts.w13_scale_inv, experts.w2,
                                  experts.w2_scale_inv, torch.bfloat16)
               if fp8 else (experts.w13, experts.w2))
    print(f"\nMoE layer: {EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, expert intermediate "
          f"{INTER}, {'FP8 experts (w8a16)' if fp8 else 'bf16'}; "
          f"{3 * HIDDEN * INTER * weight_bytes / 2**20:.1f} MiB per expert")
    print(f"{'batch':>5} {'experts':>7} {'floor us':>9} {'graph us':>9} {'x floor':>8} "
          f"{'eager us':>9} {'kernels us':>10} {'torch us':>9} {'torch/graph':>11} {'rel err':>8}")
    for batch in BATCHES:
        x = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
        weights, ids = block.route(x)
        graph, graph_out = graphed(block, x)
        graph_us = median_ms(graph.replay) * 1e3
        eager_us = median_ms(lambda x=x: block(x)) * 1e3
        kernels_us = median_ms(lambda x=x, w=weights, i=ids: experts(x, w, i)) * 1e3

        def torch_ref(x=x, w=weights, i=ids) -> torch.Tensor:
            return grouped_experts_torch(x, w13, w2, w, i).sum(dim=1)

        torch_us = median_ms(torch_ref) * 1e3
        err = rel_err(graph_out, torch_ref())
        fl = floor_us(ids, batch, bw, weight_bytes)
        print(f"{batch:>5} {int(torch.unique(ids).numel()):>7} {fl:>9.1f} {graph_us:>9.1f} "
              f"{graph_us / fl:>8.2f} {eager_us:>9.1f} {kernels_us:>10.1f} {torch_us:>9.1f} "
              f"{torch_us / graph_us:>11.1f} {err:>8.1e}", flush=True)


# -- 2. end to end -----------------------------------------------------------------------


def write_config_only_checkpoint(path: Path, layers: int) -> dict:
    """config.json (Qwen3-30B-A3B's, as released) and the tiny tokenizer; no weights."""
    s = SHAPE
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "torch_dtype": "bfloat16", "hidden_size": HIDDEN, "intermediate_size": s["dense_inter"],
        "moe_intermediate_size": INTER, "num_experts": EXPERTS, "num_experts_per_tok": TOP_K,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_hidden_layers": layers, "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "hidden_act": "silu",
        "vocab_size": s["vocab"], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "attention_bias": False,
        "use_sliding_window": False, "bos_token_id": 0, "eos_token_id": 0,
        "output_router_logits": False, "router_aux_loss_coef": 0.001,
    }  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    tiny = write_tiny_checkpoint(path / "_tok", kind="qwen3")
    shutil.copy(tiny / "tokenizer.json", path / "tokenizer.json")
    shutil.rmtree(tiny)
    return config


def fill_on_gpu(model: torch.nn.Module, *, seed: int = 0) -> None:
    """Norm weights 1, everything else normal(0, 0.02), drawn on the device.

    Stands in for ``load_format="dummy"``'s host-side uniform fill, which would take
    minutes for 30B parameters and, with norms near zero, route every token to the
    same experts (all-equal router logits), which no trained model does.
    """
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * 0.02)


def hf_step_ms(model, batch: int, new: int = 16) -> float:
    def run(n: int) -> float:
        ids = torch.tensor(prompts(batch, batch + 7), device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(2)
    return (run(new) - run(1)) / (new - 1) * 1e3


def release_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def expected_used_experts(batch: int) -> float:
    """Experts a batch routes to when each token picks TOP_K of EXPERTS at random."""
    return EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** batch)


def decode_floor_ms(config: dict, batch: int, bw: float) -> float:
    """Weights a step must read (attention, norms, routers, the LM head, and the experts
    a random routing of ``batch`` tokens touches per layer) plus the KV, over bandwidth."""
    s, layers = SHAPE, config["num_hidden_layers"]
    d = s["head_dim"]
    attn = (s["heads"] * d * 2 + s["kv_heads"] * d * 2) * HIDDEN * BF16
    experts = expected_used_experts(batch) * 3 * HIDDEN * INTER * BF16
    per_layer = attn + EXPERTS * HIDDEN * BF16 + experts
    head = s["vocab"] * HIDDEN * BF16
    kv = batch * (PROMPT + NEW // 2) * layers * 2 * s["kv_heads"] * d * BF16
    return (layers * per_layer + head + kv) / bw * 1e3


def bench_e2e(bw: float, layers: int, skip_hf: bool) -> None:
    root = Path(tempfile.mkdtemp())
    path = root / "qwen3-30b-a3b-random"
    config = write_config_only_checkpoint(path, layers)
    loader.fill_dummy_weights = fill_on_gpu  # see fill_on_gpu; in-process (TP=1) only
    start = time.perf_counter()
    llm = LLM(model=str(path), dtype="bfloat16", load_format="dummy", max_num_seqs=max(BATCHES),
              max_model_len=PROMPT + NEW + 16, max_num_batched_tokens=8192,
              gpu_memory_utilization=0.75)
    start_s = time.perf_counter() - start
    weight_gb = sum(p.nbytes for p in llm.runner.model.parameters()) / 1e9
    graphs = llm.runner.graph_capture
    capture_s, num_graphs = graphs.capture_seconds, len(graphs.graphs)
    print(f"\nQwen3-30B-A3B shape, {layers} layers: {weight_gb:.1f} GB of weights; start-up "
          f"{start_s:.1f} s, capture of {num_graphs} buckets {capture_s:.1f} s", flush=True)
    ours = {}
    for b in BATCHES:
        ours[b] = ours_step_ms(llm, b, NEW)
        print(f"ours batch {b}: {ours[b]:.3f} ms/step", flush=True)
    llm.shutdown()
    del llm
    release_memory()
    hf, impl = {}, "-"
    if not skip_hf:
        import transformers

        skip = ("architectures", "model_type", "torch_dtype")
        hf_config = transformers.Qwen3MoeConfig(**{k: v for k, v in config.items()
                                                   if k not in skip})
        hf_config._attn_implementation = "sdpa"
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                model = transformers.Qwen3MoeForCausalLM(hf_config).eval()
        finally:
            torch.set_default_dtype(torch.float32)
        fill_on_gpu(model)
        impl = str(getattr(model.config, "_experts_implementation", None) or "default")
        for b in BATCHES:
            hf[b] = hf_step_ms(model, b)
            print(f"transformers batch {b}: {hf[b]:.2f} ms/step", flush=True)
        del model
        release_memory()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; transformers experts implementation: {impl}")
    print(f"{'batch':>5} {'ours ms/step':>12} {'ours tok/s':>11} {'HF ms/step':>11} "
          f"{'HF tok/s':>9} {'speedup':>8} {'floor ms':>9} {'x floor':>8}")
    for b in BATCHES:
        fl = decode_floor_ms(config, b, bw)
        hf_ms = hf.get(b, float("nan"))
        print(f"{b:>5} {ours[b]:>12.3f} {b / ours[b] * 1e3:>11.0f} {hf_ms:>11.2f} "
              f"{b / hf_ms * 1e3:>9.0f} {hf_ms / ours[b]:>8.1f} {fl:>9.3f} {ours[b] / fl:>8.2f}")
    shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--fp8", action="store_true", help="the layer with FP8 experts too")
    args = ap.parse_args()
    bw = copy_bandwidth_tbps() * 1e12
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    bench_layer(bw)
    release_memory()
    if args.fp8:
        bench_layer(bw, fp8=True)
        release_memory()
    if not args.skip_e2e:
        bench_e2e(bw, args.layers, args.skip_hf)


if __name__ == "__main__":
    main()
