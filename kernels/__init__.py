"""LoRA ops behind one API; this module is the one place that chooses their backend.

Only the torch reference exists for now; Triton kernels will be selected here (on CUDA) behind
the same signatures, so layers never branch on the platform.
"""

from kernels.batch import NO_SLOT, LoRABatchInfo
from kernels.reference import lora_expand, lora_shrink

__all__ = ["NO_SLOT", "LoRABatchInfo", "lora_expand", "lora_shrink"]
