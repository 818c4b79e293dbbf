"""A broken adapter fails its own requests at once, with a clear error, and the batch running beside it
never notices: 8 streams of a good adapter keep going and give the tokens they give alone."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_worker.intake import GenerationRequest
from gpu_worker.lora.loader import AdapterRef
from gpu_worker.sequence import SamplingParams
from services.common.adapter_layout import directory_digest
from services.common.errors import AdapterLoadFailed

from .conftest import idle_stats, run_all, tokens_of

GOOD = "demo-r8"
MAX_NEW = 40
PROMPTS = (
    "def", "import os\nimport sys\n", "class Handler(object):\n", "for i in range(10):",
    "# A short note\n", "SELECT name FROM users WHERE", "Once upon a time", "x = [1, 2, 3]\nprint(",
)


def _edit_config(key: str, value: object) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        path = directory / "adapter_config.json"
        config = json.loads(path.read_text())
        config[key] = value
        path.write_text(json.dumps(config))
    return edit


def _truncate_config(directory: Path) -> None:
    path = directory / "adapter_config.json"
    path.write_bytes(path.read_bytes()[:25])


def _flip_a_weight_bit(directory: Path) -> None:
    path = directory / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))


def _garbage_weights(directory: Path) -> None:
    (directory / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")


# name -> (damage done to a stored copy of GOOD, whether the record follows the damage, expected cause).
# Tampered after registration, the record is the intact files' digest: the checksum refuses them. Recorded
# as damaged (by hand, or by a registry before these checks), the parse fails: bad JSON, an absurd alpha,
# or an error of the safetensors library itself, no domain error at all.
BROKEN: dict[str, tuple[Callable[[Path], None], bool, str]] = {
    "config-truncated": (_truncate_config, False, "checksum mismatch"),
    "alpha-tampered": (_edit_config("lora_alpha", 3200), False, "checksum mismatch"),
    "weights-tampered": (_flip_a_weight_bit, False, "checksum mismatch"),
    "config-truncated-as-recorded": (_truncate_config, True, "adapter_config.json is not valid JSON"),
    "alpha-1e308-as-recorded": (_edit_config("lora_alpha", 1e308), True, "lora_alpha must be a finite number"),
    "weights-garbage-as-recorded": (_garbage_weights, True, "adapter_model.safetensors: file is truncated"),
}


@pytest.fixture(scope="module")
def broken_refs(tiny_assets):
    """name -> an AdapterRef to a damaged copy of GOOD inside the worker's adapter store."""
    good = tiny_assets.adapters[GOOD]
    refs: dict[str, AdapterRef] = {}
    for name, (damage, recorded_as_damaged, _) in BROKEN.items():
        directory = tiny_assets.store / f"broken-{name}"
        shutil.copytree(good.storage_path, directory)
        # Each copy its own content, so its own version: one with GOOD's digest would be GOOD, which the
        # worker holds, verified, already.
        _edit_config("copy", name)(directory)
        recorded = directory_digest(directory)
        damage(directory)
        refs[name] = dataclasses.replace(good, name=name, storage_path=str(directory),
                                         sha256=directory_digest(directory) if recorded_as_damaged else recorded)
    yield refs
    for ref in refs.values():
        shutil.rmtree(ref.storage_path)


def _good_request(i: int, prompt: str, tiny_assets, tag: str) -> GenerationRequest:
    return GenerationRequest(f"{tag}-{i}", prompt, SamplingParams(max_tokens=MAX_NEW), tiny_assets.adapters[GOOD])


def test_broken_adapters_fail_at_once_while_eight_good_streams_run_on(engine_factory, tiny_assets, broken_refs,
                                                                      caplog):
    engine = engine_factory(adapter_slots=2)
    alone = [tokens_of(outputs) for i, prompt in enumerate(PROMPTS)
             for outputs in run_all(engine, [_good_request(i, prompt, tiny_assets, "alone")])]

    async def stream(request: GenerationRequest, received: list[tuple[float, list[int]]]) -> None:
        async for output in engine.submit(request, asyncio.get_running_loop()):
            received.append((time.monotonic(), output.token_ids))

    async def drain(handle) -> None:
        async for _ in handle:
            pass

    async def fail(ref: AdapterRef) -> tuple[float, float, AdapterLoadFailed]:
        request = GenerationRequest(f"broken-{ref.name}", "def", SamplingParams(max_tokens=MAX_NEW), ref)
        submitted = time.monotonic()
        with pytest.raises(AdapterLoadFailed) as failure:
            await asyncio.wait_for(drain(engine.submit(request, asyncio.get_running_loop())), timeout=10)
        return time.monotonic() - submitted, time.monotonic(), failure.value

    async def main():
        received: list[list[tuple[float, list[int]]]] = [[] for _ in PROMPTS]
        good = [asyncio.create_task(stream(_good_request(i, p, tiny_assets, "together"), received[i]))
                for i, p in enumerate(PROMPTS)]
        while not all(received):  # every good stream has its first token: the batch is running
            await asyncio.sleep(0.001)
        failures = await asyncio.gather(*(fail(ref) for ref in broken_refs.values()))
        await asyncio.wait_for(asyncio.gather(*good), timeout=60)
        return received, failures

    with caplog.at_level(logging.ERROR):
        received, failures = asyncio.run(main())

    last_failure = max(at for _, at, _ in failures)
    for name, (elapsed, _, error) in zip(broken_refs, failures):
        assert elapsed < 1.0, (name, elapsed)
        assert error.message.startswith(f"adapter {name} could not be loaded: "), error.message
        assert BROKEN[name][2] in error.message, error.message
        assert "Traceback" not in error.message and str(tiny_assets.store) not in error.message
    for i, stream_outputs in enumerate(received):
        # Each good stream was still producing after the last failure, and got exactly its tokens alone.
        assert stream_outputs[-1][0] > last_failure, i
        assert [t for _, ids in stream_outputs for t in ids] == alone[i], PROMPTS[i]
    # The worker's log has one line for each failure, with its cause and no traceback (each is a domain error).
    logged = [r for r in caplog.records if "could not be loaded (attempt 1;" in r.getMessage()]
    for name in broken_refs:
        (line,) = [r for r in logged if f"adapter {name} (" in r.getMessage()]
        assert BROKEN[name][2] in line.getMessage() and line.exc_info is None, line.getMessage()
    stats = idle_stats(engine)
    assert stats.running_requests == stats.waiting_requests == stats.pinned_adapters == 0
    assert stats.resident_adapters == (GOOD,)
    # The engine serves on, the good adapter as before.
    (again,) = run_all(engine, [_good_request(0, PROMPTS[0], tiny_assets, "after")])
    assert tokens_of(again) == alone[0]
