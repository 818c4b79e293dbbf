"""The CPU LoRA workers: pinned processes that compute LoRA deltas for cold-start prefill over the
shared-memory work area of their GPU worker; their contract with it and their supervision are
services/common/cpu_lora/'s."""
