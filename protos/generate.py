"""Generate the Python stubs for the tessera.v1 contracts.

One codegen command for the whole project (`python -m protos.generate`); the
outputs sit next to the .proto files and are never edited by hand.
`--check` regenerates into a temporary folder and fails if the committed
stubs differ (tests/unit/test_protos.py runs it).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_DIR = PROTO_ROOT / "tessera" / "v1"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run protoc for every contract; return the generated files."""
    out_root.mkdir(parents=True, exist_ok=True)
    builtin_includes = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{builtin_includes}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out_root / "tessera" / "v1").glob("*_pb2*.py*"))


def check() -> list[str]:
    """Names of committed stubs that differ from freshly generated ones."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for path in fresh:
            committed = PROTO_DIR / path.name
            if not committed.exists() or not filecmp.cmp(path, committed, shallow=False):
                stale.append(path.name)
        return stale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    opts = parser.parse_args()
    if opts.check:
        stale = check()
        if stale:
            print("stale stubs (run `python -m protos.generate`):", ", ".join(stale))
            return 1
        print("stubs match the .proto files")
        return 0
    for path in generate(PROTO_ROOT):
        print("wrote", path.relative_to(PROTO_ROOT.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
