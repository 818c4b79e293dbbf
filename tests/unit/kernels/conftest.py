"""Kernel tests run Triton on CPU: the interpreter must be chosen before triton is imported."""

import os

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


if os.environ["TRITON_INTERPRET"] == "1":
    _index_scalars_for_numpy_2_4()
