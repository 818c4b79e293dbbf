"""The CPU LoRA workers' contract with the GPU worker they serve (CaraServe's CPU-assisted prefill), and
their supervision, in one place: the shared-memory work area (`shm.py`), the arithmetic both sides run
(`delta.py`), where the workers run (`numa.py`), the processes that run them (`supervisor.py`: the GPU
worker's own, or a sidecar's) and the handshake with a sidecar that runs them (`sidecar.py`). The
compute loop itself is the cpu_lora_worker role's.

Nothing is imported here: numa.py is standard library only, the other modules need torch."""
