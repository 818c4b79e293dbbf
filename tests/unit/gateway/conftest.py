"""The gateway tests' gRPC client: an Inference stub on the module's `env` (a GatewayEnv fixture each module
defines for its own registry and workers)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from tessera.v1 import inference_pb2_grpc

from tests.unit.gateway.gateway_fakes import GatewayEnv


@pytest.fixture
def stub(env: GatewayEnv) -> Iterator[inference_pb2_grpc.InferenceStub]:
    with grpc.insecure_channel(env.grpc_address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)
