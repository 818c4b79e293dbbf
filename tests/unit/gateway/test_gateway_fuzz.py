"""Property-based fuzzing of both front doors: whatever a client sends, never a server error.

REST: schemathesis (its CLI, the full engine: boundary-value coverage, then fuzzing; its pytest
plugin does not run under pytest 9) reads the
gateway's own /openapi.json and sends what it describes, valid bodies and bodies breaking the
schema one way or another, to a real gateway over fake workers. Every answer must be no 5xx,
conform to the document (status, content type, body, Retry-After), reject what breaks the
schema with a 4xx, and be a 401 without the API key. One edit to the fetched document: `model`
is pinned to the fake deployment's names (its head adapters for /v1/classify), so valid bodies reach a
worker instead of all ending as 404 for a random model name.
gRPC: hypothesis builds GenerateRequest messages field by field from their proto descriptors, and
sends some of them damaged on the wire (a string field holding bytes that are not UTF-8, garbage
appended, a truncated message), and ListModels arbitrary bytes; no call may end INTERNAL or
UNKNOWN, and nothing may be logged as an error.
Both are bounded by example counts and seeded, so CI sees the same inputs each run (~25 s on two cores).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message as protobuf_message
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.gateway.gateway_fakes import ADAPTER, BASE, CLASSIFIER, DETECTOR, GatewayEnv, with_head_adapters
from tessera.v1 import inference_pb2

KEY = "fuzz-key"
REST_EXAMPLES = 150  # per operation, in the fuzzing phase (the coverage phase's boundary values come on top)
REST_CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
               "response_schema_conformance,negative_data_rejection,missing_required_header,unsupported_method,"
               "allow_header_conformance,ignored_auth")
GRPC_EXAMPLES = 1000
SERVER_ERRORS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


@pytest.fixture(scope="module")
def env() -> Iterator[GatewayEnv]:
    env = with_head_adapters(GatewayEnv(api_keys=[KEY]))
    yield env
    env.close()


def test_rest_answers_every_request_as_documented_and_never_with_a_server_error(
        env: GatewayEnv, tmp_path: Path) -> None:
    with urllib.request.urlopen(f"{env.http_base}/openapi.json", timeout=10) as reply:  # no key needed
        document = json.load(reply)
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        document["components"]["schemas"][name]["properties"]["model"] = {"enum": [BASE, ADAPTER]}
    document["components"]["schemas"]["ClassifyRequest"]["properties"]["model"] = {"enum": [CLASSIFIER, DETECTOR]}
    (tmp_path / "openapi.json").write_text(json.dumps(document))
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", "openapi.json", "--url", env.http_base,
         "--header", f"Authorization: Bearer {KEY}", "--checks", REST_CHECKS, "--phases", "coverage,fuzzing",
         "--max-examples", str(REST_EXAMPLES), "--seed", "38", "--generation-database", "none", "--workers", "1",
         "--request-timeout", "20", "--no-color"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-20_000:] + run.stderr[-5_000:]
    assert "No issues found" in run.stdout, run.stdout[-5_000:]


# gRPC: messages from their descriptors.

_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_INT32: st.integers(-2**31, 2**31 - 1),
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_INT64: st.integers(-2**63, 2**63 - 1),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32),
    FieldDescriptor.TYPE_DOUBLE: st.floats(),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=64),
}
# Values worth drawing often, by field name: valid ones, so that requests get past validation to a
# worker, and the limits with either side of them. The full range of the field's type comes on top.
_LIKELY: dict[str, list[Any]] = {
    "model": [BASE, ADAPTER], "role": ["system", "user", "assistant"],
    "max_tokens": [0, 1, 8, 64, 65, -1], "top_k": [0, 1, 40, 2**31 - 1, -1], "logprobs": [0, 2, 20, 21, -1],
    "stop_token_ids": [0, 3, 2**31 - 1, -1], "seed": [0, 1, 2**64 - 1],
    "temperature": [0.0, 0.7, 2.0, 2.5], "top_p": [0.0, 0.9, 1.0, 1.5],
    "tpot_ms": [0.0, 50.0, 1.0, 5e-324], "ttft_ms": [0.0, 2000.0, 3_600_001.0],
}


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    full = st.text(max_size=40) if field.type == FieldDescriptor.TYPE_STRING else _SCALARS[field.type]
    likely = _LIKELY.get(field.name)
    return st.sampled_from(likely) | full if likely else full


@st.composite
def messages(draw: st.DrawFn, descriptor: Descriptor, depth: int = 0) -> protobuf_message.Message:
    """A message of `descriptor` with each field set or not, and at most one field per oneof."""
    built = message_factory.GetMessageClass(descriptor)()
    chosen_oneofs = {oneof.name: draw(st.sampled_from([*oneof.fields, None])) for oneof in descriptor.oneofs}
    for field in descriptor.fields:
        if field.containing_oneof is not None:
            if chosen_oneofs[field.containing_oneof.name] is not field:
                continue
        elif depth > 3 or not draw(st.sampled_from([True, True, True, False])):  # mostly set
            continue
        if field.is_repeated:
            getattr(built, field.name).extend(draw(st.lists(_value(field, depth), max_size=5)))
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(built, field.name).CopyFrom(draw(_value(field, depth)))
        else:
            setattr(built, field.name, draw(_value(field, depth)))
    return built


def _string_field_with_invalid_utf8(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """One top-level string field on the wire holding bytes that do not decode as UTF-8."""
    strings = [f.number for f in descriptor.fields if f.type == FieldDescriptor.TYPE_STRING]
    invalid = st.binary(min_size=1, max_size=16).filter(lambda b: not _decodes(b))
    return st.builds(lambda number, raw: bytes([number << 3 | 2, len(raw)]) + raw, st.sampled_from(strings), invalid)


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@st.composite
def wire(draw: st.DrawFn, descriptor: Descriptor) -> bytes:
    """A serialized message: as is (half the time), or damaged one of three ways."""
    data = draw(messages(descriptor)).SerializeToString()
    damage = draw(st.sampled_from([None, None, None, "invalid utf-8", "garbage", "truncated"]))
    if damage == "invalid utf-8":
        return data + draw(_string_field_with_invalid_utf8(descriptor))
    if damage == "garbage":
        return data + draw(st.binary(min_size=1, max_size=32))
    if damage == "truncated" and data:
        return data[:draw(st.integers(0, len(data) - 1))]
    return data


@pytest.fixture(scope="module")
def channel(env: GatewayEnv) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(env.grpc_address) as channel:
        yield channel


def _status(call: Any) -> grpc.StatusCode:
    try:
        for _ in call:
            pass
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@settings(max_examples=GRPC_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=wire(inference_pb2.GenerateRequest.DESCRIPTOR))
def test_grpc_generate_never_ends_internal_or_unknown(channel: grpc.Channel, request: bytes,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.clear()
    generate = channel.unary_stream("/tessera.v1.Inference/Generate", request_serializer=None,
                                    response_deserializer=None)
    status = _status(generate(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=20))
    assert status not in SERVER_ERRORS, request
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=st.binary(max_size=32))
def test_grpc_list_models_never_ends_internal_or_unknown(channel: grpc.Channel, request: bytes) -> None:
    list_models = channel.unary_unary("/tessera.v1.Inference/ListModels", request_serializer=None,
                                      response_deserializer=None)
    try:
        list_models(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=20)
    except grpc.RpcError as error:
        assert error.code() not in SERVER_ERRORS, error.details()

