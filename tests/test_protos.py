"""The committed gRPC stubs must match what scripts/gen_protos.py generates now."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_fresh(tmp_path):
    generated = load_generator().generate(tmp_path)
    assert generated, "protoc produced no files"
    for path in generated:
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed.relative_to(ROOT)} is missing: run python scripts/gen_protos.py"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.relative_to(ROOT)} is stale: run python scripts/gen_protos.py and commit the result"
        )


def test_every_committed_stub_has_a_proto():
    committed = sorted((ROOT / "specdec" / "v1").glob("*_pb2*.py*"))
    protos = {p.stem for p in (ROOT / "proto" / "specdec" / "v1").glob("*.proto")}
    for path in committed:
        stem = path.name.split("_pb2")[0]
        assert stem in protos, f"{path.name} has no .proto source: delete it or restore the proto"
