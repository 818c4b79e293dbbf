"""Suite-wide: without a CUDA device, Triton kernels run in Triton's interpreter. The choice must
be made before anything imports triton, and test modules (tests/gpu too, collected though
deselected) import kernels at collection, so it is made here, first."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _index_scalars_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into loop bounds
    (`range(lo, hi)` with runtime bounds) through int(array), which NumPy >= 2.4 refuses; index
    them through .item() instead. Only the interpreter is touched; compiled kernels are unaffected."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "indexes_scalars", False):
        return

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched.indexes_scalars = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _index_scalars_for_numpy_2_4()
