"""Request validation: every malformed field is an InvalidArgument naming its param."""

from __future__ import annotations

import pytest

from gateway.schemas import parse_chat_request, parse_completion_request, validate_generate_request
from services.common.config import GatewayConfig
from services.common.errors import InvalidArgument
from tessera.v1 import common_pb2, inference_pb2

CONFIG = GatewayConfig(max_tokens_limit=100, default_max_tokens=7, max_prompt_chars=50)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat_error(**fields) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        parse_chat_request({**CHAT, **fields}, CONFIG)
    return info.value


def test_chat_defaults_and_fields() -> None:
    api = parse_chat_request({**CHAT, "temperature": 1, "top_p": 0.5, "top_k": 3, "stop": "x", "seed": 0,
                              "n": 1, "stream": True, "stream_options": {"include_usage": True},
                              "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}, CONFIG)
    sampling = api.generate.sampling
    assert (api.generate.model, api.stream, api.include_usage) == ("m", True, True)
    assert api.generate.chat.messages[0].content == "hi"
    assert sampling.max_tokens == CONFIG.default_max_tokens
    assert (sampling.temperature, sampling.top_p, sampling.top_k, list(sampling.stop)) == (1.0, 0.5, 3, ["x"])
    assert sampling.HasField("seed") and sampling.seed == 0
    assert not api.generate.request_id, "the REST id is the gateway's (openai_api), not a label made here"


@pytest.mark.parametrize("parse, body", [(parse_chat_request, CHAT), (parse_completion_request, {"model": "m",
                                                                                                  "prompt": "hi"})])
@pytest.mark.parametrize("extra, param, message", [
    ({"max_token": 4}, "max_token", "unrecognized request argument supplied: max_token; the accepted ones are model, "),
    ({"response_format": {"type": "json_object"}}, "response_format",
     "response_format is an OpenAI parameter that Tessera does not support yet"),
    ({"tools": []}, "tools", "tools is an OpenAI parameter that Tessera does not support yet"),
    ({"presence_penalty": 0.5}, "presence_penalty", "presence_penalty must be 0, got 0.5"),
    ({"frequency_penalty": -1}, "frequency_penalty", "frequency_penalty must be 0, got -1"),
    ({"logit_bias": {"5": 10}}, "logit_bias", "logit_bias must be"),
])
def test_an_argument_not_served_is_a_400_naming_it_never_ignored(parse, body, extra: dict, param: str,
                                                                 message: str) -> None:
    """`"max_token": 4` (a typo) once produced 256 tokens: OpenAI answers it with a 400, and so does Tessera."""
    with pytest.raises(InvalidArgument) as info:
        parse({**body, **extra}, CONFIG)
    assert info.value.param == param and info.value.message.startswith(message), info.value.message


@pytest.mark.parametrize(("fields", "wanted"), [
    ({}, None),
    ({"logprobs": False}, None),
    ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 20}, 20),
    ({"logprobs": True, "top_logprobs": None}, 0),
])
def test_chat_logprobs_set_the_count_of_alternatives(fields: dict, wanted: int | None) -> None:
    sampling = parse_chat_request({**CHAT, **fields}, CONFIG).generate.sampling
    assert sampling.HasField("logprobs") == (wanted is not None)
    assert sampling.logprobs == (wanted or 0)


def test_completion_logprobs_are_a_count() -> None:
    body = {"model": "m", "prompt": "hi"}
    assert not parse_completion_request(body, CONFIG).generate.sampling.HasField("logprobs")
    sampling = parse_completion_request({**body, "logprobs": 0}, CONFIG).generate.sampling
    assert sampling.HasField("logprobs") and sampling.logprobs == 0
    assert parse_completion_request({**body, "logprobs": 5}, CONFIG).generate.sampling.logprobs == 5


@pytest.mark.parametrize(("logprobs", "phrase"), [
    (6, "between 0 and 5"), (-1, "between 0 and 5"), (True, "must be an integer"), ("2", "must be an integer")])
def test_completion_rejects_logprobs(logprobs: object, phrase: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_completion_request({"model": "m", "prompt": "hi", "logprobs": logprobs}, CONFIG)
    assert info.value.param == "logprobs" and phrase in info.value.message


def test_stop_token_ids_reach_the_proto_from_both_endpoints() -> None:
    ids = [0, 7, 2**31 - 1]
    assert list(parse_chat_request({**CHAT, "stop_token_ids": ids}, CONFIG).generate.sampling.stop_token_ids) == ids
    completion = parse_completion_request({"model": "m", "prompt": "hi", "stop_token_ids": [3] * 64}, CONFIG)
    assert list(completion.generate.sampling.stop_token_ids) == [3] * 64
    for absent in ({}, {"stop_token_ids": None}, {"stop_token_ids": []}):
        assert not parse_chat_request({**CHAT, **absent}, CONFIG).generate.sampling.stop_token_ids


def test_completion_rejects_stop_token_ids() -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_completion_request({"model": "m", "prompt": "hi", "stop_token_ids": [1, -2]}, CONFIG)
    assert info.value.param == "stop_token_ids[1]" and "stop_token_ids[1] must be" in info.value.message


def test_integral_numbers_are_integers_as_in_json_schema() -> None:
    """JSON has one number type: 5.0 is the integer 5 (JSON Schema's `integer`), 5.5 is not."""
    sampling = parse_chat_request({**CHAT, "max_tokens": 5.0, "logprobs": True, "top_logprobs": 2.0,
                                   "stop_token_ids": [1.0], "seed": 3.0}, CONFIG).generate.sampling
    assert (sampling.max_tokens, sampling.logprobs, list(sampling.stop_token_ids), sampling.seed) == (5, 2, [1], 3)


def test_text_parts_are_joined_and_max_completion_tokens_is_accepted() -> None:
    api = parse_chat_request({**CHAT, "max_completion_tokens": 9, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, CONFIG)
    assert api.generate.chat.messages[0].content == "a\nb"
    assert api.generate.sampling.max_tokens == 9


@pytest.mark.parametrize(("fields", "param", "phrase"), [
    ({"model": ""}, "model", "model must be a non-empty string"),
    ({"model": 3}, "model", "model must be a non-empty string, got 3"),
    ({"model": "m" * 257}, "model", "model is too long: 257 characters, the limit is 256"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": "hi"}, "messages", "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "string or a list"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]", "must be a base64 data URL"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0].type", '"audio"'),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text", "is required"),
    ({"messages": [{"role": "user", "content": "x" * 51}]}, "messages[0].content", "too long"),
    ({"messages": [{"role": "user", "content": "x" * 30}, {"role": "user", "content": "x" * 30}]}, "messages",
     "too long: 60 characters"),
    ({"max_tokens": -1}, "max_tokens", "between 1 and 100"),
    ({"max_tokens": 0}, "max_tokens", "between 1 and 100"),
    ({"max_tokens": 10**20}, "max_tokens", "between 1 and 100"),
    ({"max_tokens": 2.5}, "max_tokens", "must be an integer"),
    ({"max_tokens": "5"}, "max_tokens", "must be an integer"),
    ({"max_tokens": True}, "max_tokens", "must be an integer"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "between 1 and 100"),
    ({"temperature": -0.1}, "temperature", "between 0 and 2"),
    ({"temperature": 2.5}, "temperature", "between 0 and 2"),
    ({"temperature": "hot"}, "temperature", "must be a number"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_k": -1}, "top_k", "between 0 and 2147483647"),
    ({"top_k": 2**70}, "top_k", "between 0 and 2147483647"),
    ({"seed": 2**64}, "seed", "between 0 and 18446744073709551615"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"stop": [""]}, "stop[0]", "non-empty"),
    ({"stop": [1]}, "stop[0]", "must be a non-empty string"),
    ({"stop": 1}, "stop", "a non-empty string or a list of non-empty strings"),
    ({"stop": ["x" * 1025]}, "stop[0]", "too long: 1025 characters, the limit is 1024"),
    ({"seed": -1}, "seed", "between 0 and"),
    ({"stop_token_ids": 5}, "stop_token_ids", "must be a list of integers between 0 and 2147483647"),
    ({"stop_token_ids": [1, True]}, "stop_token_ids[1]", "must be an integer"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids[0]", "must be an integer"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids[0]", "must be an integer"),
    ({"stop_token_ids": [None]}, "stop_token_ids[0]", "must be an integer"),
    ({"stop_token_ids": [4, -1]}, "stop_token_ids[1]", "stop_token_ids[1] must be an integer between 0 and"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids[0]", "stop_token_ids[0] must be an integer between 0 and"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids", "at most 64 items, got 65"),
    ({"n": 2}, "n", "n must be 1, got 2"),
    ({"stream": "yes"}, "stream", "boolean"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ({"logprobs": 1}, "logprobs", "must be a boolean"),
    ({"logprobs": "true"}, "logprobs", "must be a boolean"),
    ({"top_logprobs": 2}, "top_logprobs", "requires logprobs to be true"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs", "requires logprobs to be true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "between 0 and 20"),
    ({"logprobs": True, "top_logprobs": 2.5}, "top_logprobs", "must be an integer"),
])
def test_chat_rejects(fields: dict, param: str, phrase: str) -> None:
    error = chat_error(**fields)
    assert error.param == param
    assert phrase in error.message


def test_missing_model_and_non_object_body() -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_chat_request({"messages": CHAT["messages"]}, CONFIG)
    assert info.value.param == "model"
    with pytest.raises(InvalidArgument, match="JSON object"):
        parse_chat_request([CHAT], CONFIG)


def test_completion_prompt() -> None:
    assert parse_completion_request({"model": "m", "prompt": ["one"]}, CONFIG).generate.text == "one"
    for prompt in ("", None, ["a", "b"], 5):
        with pytest.raises(InvalidArgument) as info:
            parse_completion_request({"model": "m", "prompt": prompt}, CONFIG)
        assert info.value.param == "prompt"


def test_proto_zero_values_mean_default() -> None:
    request = inference_pb2.GenerateRequest(model="m", text="hi")
    checked = validate_generate_request(request, CONFIG)
    assert checked.sampling.max_tokens == CONFIG.default_max_tokens
    assert request.sampling.max_tokens == 0, "the caller's request is not modified"


@pytest.mark.parametrize(("request_", "param"), [
    (inference_pb2.GenerateRequest(text="hi"), "model"),
    (inference_pb2.GenerateRequest(model="m"), "prompt"),
    (inference_pb2.GenerateRequest(model="m", text=""), "prompt"),
    (inference_pb2.GenerateRequest(model="m", chat=common_pb2.ChatPrompt()), "messages"),
    (inference_pb2.GenerateRequest(model="m", text="hi", sampling=common_pb2.SamplingParams(max_tokens=-3)),
     "max_tokens"),
    (inference_pb2.GenerateRequest(model="m", text="hi", sampling=common_pb2.SamplingParams(temperature=3)),
     "temperature"),
    (inference_pb2.GenerateRequest(model="m", text="hi", sampling=common_pb2.SamplingParams(top_p=-0.5)), "top_p"),
    (inference_pb2.GenerateRequest(model="m", text="hi", sampling=common_pb2.SamplingParams(logprobs=21)),
     "logprobs"),
    (inference_pb2.GenerateRequest(model="m", text="hi", sampling=common_pb2.SamplingParams(logprobs=-1)),
     "logprobs"),
    (inference_pb2.GenerateRequest(model="m", text="hi", sampling=common_pb2.SamplingParams(stop_token_ids=[2, -1])),
     "stop_token_ids[1]"),
    (inference_pb2.GenerateRequest(model="m" * 257, text="hi"), "model"),
    (inference_pb2.GenerateRequest(model="m", text="hi", sampling=common_pb2.SamplingParams(stop=["a", ""])),
     "stop[1]"),
    (inference_pb2.GenerateRequest(model="m", text="hi", sampling=common_pb2.SamplingParams(stop=["x" * 1025])),
     "stop[0]"),
    (inference_pb2.GenerateRequest(model="m", text="hi",
                                   sampling=common_pb2.SamplingParams(stop_token_ids=[1] * 65)), "stop_token_ids"),
])
def test_proto_rejects(request_: inference_pb2.GenerateRequest, param: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_generate_request(request_, CONFIG)
    assert info.value.param == param
