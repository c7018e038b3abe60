"""FP8 (e4m3) weights with 128 x 128 block scales, the layout of Qwen's and DeepSeek's
FP8 checkpoints (``weight`` in ``float8_e4m3fn`` beside ``weight_scale_inv`` in
float32, one scale per block): the block quantization (``blocks.py``), the linear
layers' storage and loading (``weights.py``), the product (``gemm.py``; its w8a16
kernel for a decode step's rows, ``w8a16_triton.py``), the
mixture-of-experts layer's stacked experts (``experts.py``; their product is the
grouped Triton kernels', ``layers/fused/moe_triton.py``) and the ``quantization``
choice (``choice.py``)."""
