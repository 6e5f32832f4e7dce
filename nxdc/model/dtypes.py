"""The plan's dtype names ("fp32", "bf16", "fp16") as torch dtypes."""

import torch

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
