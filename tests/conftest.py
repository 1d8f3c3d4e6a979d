import os

import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. The variable must be set before
# any kernel module is imported (triton.jit reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
