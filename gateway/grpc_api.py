"""The public gRPC front door (tessera.v1.Inference): a thin servicer over GatewayCore.

Errors are services.common.errors raised by the core; the shared interceptor maps them to status
codes (bad input INVALID_ARGUMENT, unknown model NOT_FOUND, no worker UNAVAILABLE).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from tessera.v1 import common_pb2, inference_pb2, inference_pb2_grpc

from gateway.core import GatewayCore
from gateway.metrics import count_grpc_request

SERVICE_NAME = "tessera.v1.Inference"


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, core: GatewayCore) -> None:
        self._core = core

    async def Generate(self, request: inference_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.GenerateResponse]:
        with count_grpc_request("grpc:Generate"):
            async for response in self._core.generate(request):
                yield response

    async def ListModels(self, request: inference_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> inference_pb2.ListModelsResponse:
        with count_grpc_request("grpc:ListModels"):
            return inference_pb2.ListModelsResponse(models=await self._core.list_models())

    async def Classify(self, request: inference_pb2.ClassifyRequest,
                       context: grpc.aio.ServicerContext) -> inference_pb2.ClassifyResponse:
        with count_grpc_request("grpc:Classify"):
            return await self._core.classify(request)
