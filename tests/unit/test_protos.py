"""The committed stubs are exactly what the codegen command produces from the .proto files."""

from protos.generate import check


def test_committed_stubs_match_proto_files():
    assert check() == [], "stale stubs: run `python -m protos.generate`"


def test_stubs_import_as_tessera_v1():
    from tessera.v1 import inference_pb2_grpc, registry_pb2_grpc, worker_pb2_grpc

    assert hasattr(inference_pb2_grpc, "InferenceStub")
    assert hasattr(worker_pb2_grpc, "WorkerServiceStub")
    assert hasattr(registry_pb2_grpc, "RegistryStub")
