"""Numerical tolerances of the ops against their reference twins, stated once.

``(atol, rtol)`` per dtype of the op's inputs, for ``torch.testing.assert_close``. Kernels compute
in fp32 internally; the tolerance covers the rounding of the output and a different order of
floating-point reductions. Attention and sampling logprobs accumulate over long rows and get
their own entries.

One exception: the Triton MLA / DSA attention in fp16 / bf16 rounds the latent query
``q_nope @ w_uk`` (and the prefill's expanded K / V) to the input dtype before the kernel, as vLLM's
and FlashMLA's kernels do. Each logit then moves by up to about one rounding step of its own size
(2**-8 of it in bf16), so ``ATTENTION`` holds for logits of about unit spread (the tests' inputs) and
the distance to the twin grows with sharper attention (bf16, logits of standard deviation 7.5: about
3.7e-2 against the twin's 7.8e-3 from exact).
"""

import torch

ELEMENTWISE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}

ATTENTION = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

# Fused MoE: fp16/bf16 round the activation between the two GEMMs; a one-ulp flip there moves an
# output by an absolute amount, which near-cancelling outputs see as a large relative error.
MOE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (4e-3, 2e-3),
    torch.bfloat16: (3e-2, 1.6e-2),
}

# fp8 (e4m3) KV cache: 3 mantissa bits, relative step 2**-3 before scaling.
FP8_KV = (6e-2, 6e-2)

# Scaled GEMMs (fp8 / int8 operands, fp32 accumulation) by output dtype, for outputs of order 1: the
# kernels scale the accumulator where the twin first dequantizes each operand (one fp32 rounding per
# element), and they sum in another order; fp16/bf16 outputs add their own rounding (a one-ulp flip).
SCALED_MM = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

# Quantized values against the twin's, by format: at most one step apart (a backend that multiplies by
# 1 / scale instead of dividing may round a near-tie the other way; fp8's step is 2**-3 of the value,
# 2**-9 below its smallest normal). Scales: fp32 rounding of amax / qmax.
QUANT_VALUES = {
    torch.float8_e4m3fn: (2.0**-9, 0.125),
    torch.int8: (1.0, 0.0),
}
QUANT_SCALE = (0.0, 1e-6)


def tolerance(dtype: torch.dtype, table=ELEMENTWISE) -> dict:
    atol, rtol = table[dtype]
    return {"atol": atol, "rtol": rtol}
