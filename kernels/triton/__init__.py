"""The Triton kernels behind kernels' ops, and what serves them (PDL, compiling ahead, warm-ups).

Every module here imports triton; nothing else in kernels does, so a CPU-only install imports
kernels without it. Only kernels/__init__.py, the one place that picks each op's backend, reaches
these modules from the ops, on the first call with CUDA tensors. Each op's contract, dataclasses
and torch reference live one level up (kernels/batch.py, lora_stack.py, attention.py, merge.py,
fused.py, reference.py); the modules here import those, never the other way round.
"""
