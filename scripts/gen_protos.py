"""Regenerate the committed gRPC stubs from proto/specdec/v1/*.proto.

Usage: python scripts/gen_protos.py [--out DIR]

The stubs land in specdec/v1/ (the proto package `specdec.v1` maps onto the
Python package `specdec.v1`), so imports read `from specdec.v1 import specdec_pb2`.
tests/test_protos.py regenerates into a temporary folder and fails if the
committed files differ.
"""

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc (from grpcio-tools) over every .proto; return the files written."""
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(PROTO_ROOT.glob("specdec/v1/*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_dir / "specdec" / "v1").glob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT, help="output root (default: repo root)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))


if __name__ == "__main__":
    sys.exit(main())
