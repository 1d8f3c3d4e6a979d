"""Numerical tolerances of the ops against their reference twins, stated once.

``(atol, rtol)`` per dtype of the op's inputs, for ``torch.testing.assert_close``. Kernels compute
in fp32 internally; the tolerance covers the rounding of the output and a different order of
floating-point reductions. Attention and sampling logprobs accumulate over long rows and get
their own entries.
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


def tolerance(dtype: torch.dtype, table=ELEMENTWISE) -> dict:
    atol, rtol = table[dtype]
    return {"atol": atol, "rtol": rtol}
