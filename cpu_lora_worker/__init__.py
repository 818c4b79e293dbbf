"""The CPU LoRA workers: pinned processes that compute LoRA deltas for cold-start prefill over the
shared-memory work area of their GPU worker (services/common/lora_shm.py)."""
