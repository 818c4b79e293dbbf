"""Suite-wide: without a CUDA device, Triton kernels run in Triton's interpreter; with one, the CUDA
allocator uses expandable segments (below). The choices must be made before anything imports triton
or allocates on the device, and test modules (tests/gpu too, collected though deselected) import
kernels at collection, so they are made here, first."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # The GPU tests build and drop many engines in one process, each sizing its KV cache to most of
    # the device. With whole segments, a small tensor allocated after an engine's cache was freed is
    # carved from that segment and keeps all of it reserved: the next engine's cache then does not
    # fit (docs/benchmarks/engine.md has the case that showed it). Expandable segments
    # give back every free page (tests/unit/gpu_worker/conftest.py's make_engine empties the cache first).
    # Read when the allocator starts, i.e. at the first CUDA tensor, after this module is loaded.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


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


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL server of this session's own (tests/postgres.py), started at the first test that asks."""
    from tests.postgres import PostgresServer

    server = PostgresServer()
    yield server
    server.stop()
