"""Remote http(s) image URLs (gateway/remote_images.py) against a local HTTP server: refused unless
enabled; once enabled, fetched within the byte limit, the timeout and the redirect limit, every
redirect re-checked, loopback/private hosts refused unless allowed, and the bytes checked as inline
images are. Failures are clear 400s (413 for too many bytes) naming the URL, and the gateway goes on
fetching afterwards."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from urllib.parse import quote

import pytest

from gateway.images import image_from_url, video_from_url
from gateway.remote_images import _public
from gateway.schemas import parse_chat_request
from services.common.config import GatewayConfig
from services.common.errors import InvalidArgument, PayloadTooLarge
from tests.images import gradient_image
from tests.unit.gateway.image_server import SLOW_S, ImageServer

MAX_BYTES = 4000
TIMEOUT_S = 0.5
PNG = gradient_image(1, (24, 16), "PNG")
GIF = gradient_image(2, (8, 8), "GIF")
PARAM = "messages[0].content[0]"
# Enabled, and allowed to reach this machine: the test server is on loopback.
LOCAL = GatewayConfig(remote_images=True, remote_image_allow_private=True, remote_image_timeout_s=TIMEOUT_S,
                      max_image_bytes=MAX_BYTES)


@pytest.fixture(scope="module")
def server() -> Iterator[ImageServer]:
    with ImageServer({"/cat.png": PNG, "/cat.gif": GIF}) as server:
        yield server


def _fetch(url: str, config: GatewayConfig = LOCAL) -> bytes:
    return image_from_url(url, config, PARAM)


def _refusal(url: str, config: GatewayConfig = LOCAL, error: type[InvalidArgument] = InvalidArgument) -> str:
    with pytest.raises(error) as info:
        _fetch(url, config)
    assert type(info.value) is error and info.value.param == PARAM
    return info.value.message


def test_disabled_by_default(server: ImageServer) -> None:
    assert not GatewayConfig().remote_images
    for url in (server.url("/cat.png"), "HTTPS://example.com/cat.png"):
        assert "remote image URLs are disabled" in _refusal(url, GatewayConfig())
    assert server.paths == [], "a disabled gateway never connects"


def test_fetches_an_image_directly_and_through_a_redirect(server: ImageServer) -> None:
    assert _fetch(server.url("/cat.png")) == PNG
    assert _fetch(server.url("/redirect?to=/cat.png")) == PNG
    absolute = quote(server.url("/cat.png"), safe="")
    assert _fetch(server.url(f"/redirect?to={absolute}")) == PNG
    assert _fetch(server.url("/unsized?bytes=100")).startswith(b"\x89PNG")  # a body ended by closing


def test_fetched_bytes_are_checked_like_inline_images(server: ImageServer) -> None:
    def chat(url: str) -> dict:
        return {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}]}
    request = parse_chat_request(chat(server.url("/cat.png")), LOCAL).generate
    assert request.chat.messages[0].parts[0].image == PNG
    with pytest.raises(InvalidArgument, match="format GIF is not supported") as info:
        parse_chat_request(chat(server.url("/cat.gif")), LOCAL)
    assert info.value.param == PARAM


@pytest.mark.parametrize(("path", "phrase"), [
    (f"/sized?bytes={MAX_BYTES + 1}", f"is {MAX_BYTES + 1} bytes; the limit is {MAX_BYTES}"),   # by its header
    (f"/unsized?bytes={50 * MAX_BYTES}", f"is over {MAX_BYTES} bytes; the limit is {MAX_BYTES}"),  # by reading
], ids=["content-length", "no-content-length"])
def test_too_many_bytes_is_413(server: ImageServer, path: str, phrase: str) -> None:
    started = time.monotonic()
    assert phrase in _refusal(server.url(path), error=PayloadTooLarge)
    assert time.monotonic() - started < TIMEOUT_S, "refused at once, without waiting for the rest"


@pytest.mark.parametrize(("path", "phrase"), [
    ("/missing", "the server answered HTTP 404"),
    ("/loop", "it redirects more than 3 times"),
    ("/redirect?to=file:///etc/passwd", "only http and https URLs are fetched, not file"),
    ("/redirect?to=ftp://127.0.0.1/cat.png", "only http and https URLs are fetched, not ftp"),
    ("/slow", f"timed out after {TIMEOUT_S:g} s"),
    ("/drip", f"timed out after {TIMEOUT_S:g} s"),  # every read is quick; the whole download is not
], ids=["404", "redirect-loop", "redirect-to-file", "redirect-to-ftp", "slow", "drip"])
def test_failed_fetch_is_a_clear_400(server: ImageServer, path: str, phrase: str) -> None:
    started = time.monotonic()
    message = _refusal(server.url(path))
    assert message.startswith(f"could not fetch image URL {server.url(path)}") and phrase in message, message
    assert time.monotonic() - started < TIMEOUT_S + 1.0
    assert _fetch(server.url("/cat.png")) == PNG, "the next fetch works"


def test_unreachable_host_is_a_clear_400_without_internals(server: ImageServer) -> None:
    with ImageServer({}) as gone:
        url = gone.url("/cat.png")
    assert _refusal(url) == f"could not fetch image URL {url}: the connection was refused"
    assert "could not be resolved" in _refusal("http://no-such-host.invalid/cat.png")
    assert "not a valid URL" in _refusal("http://127.0.0.1:99999/cat.png")
    assert "not a valid URL" in _refusal(server.url("/a cat.png"))
    tls = server.url("/cat.png").replace("http:", "https:")  # TLS to a plain HTTP server
    assert _refusal(tls) == f"could not fetch image URL {tls}: the TLS handshake failed"


def test_a_slow_fetch_does_not_hold_up_others(server: ImageServer) -> None:
    errors: list[InvalidArgument] = []

    def slow_fetch() -> None:
        try:
            _fetch(server.url("/slow"), dataclasses.replace(LOCAL, remote_image_timeout_s=SLOW_S / 2))
        except InvalidArgument as exc:
            errors.append(exc)
    slow = threading.Thread(target=slow_fetch)
    slow.start()
    time.sleep(0.1)
    started = time.monotonic()
    assert _fetch(server.url("/cat.png")) == PNG
    assert time.monotonic() - started < 1.0
    slow.join()
    assert len(errors) == 1 and f"timed out after {SLOW_S / 2:g} s" in errors[0].message


def test_loopback_and_private_hosts_are_refused_by_default(server: ImageServer) -> None:
    config = dataclasses.replace(LOCAL, remote_image_allow_private=False)
    before = len(server.paths)
    for url in (server.url("/cat.png"), server.url("/cat.png", host="localhost"),
                server.url("/cat.png", host="[::1]"), server.url("/cat.png", host="[::ffff:127.0.0.1]"),
                "http://10.1.2.3/cat.png", "http://169.254.169.254/latest/meta-data/"):
        message = _refusal(url, config)
        assert "non-public address; this gateway does not fetch from those" in message, message
    by_name = _refusal(server.url("/cat.png", host="localhost"), config)
    assert "host localhost resolves to a loopback" in by_name
    assert "127.0.0.1" not in by_name and "::1" not in by_name, "the resolved addresses are not shown"
    assert len(server.paths) == before, "refused before connecting"


def test_public_addresses() -> None:
    assert _public("8.8.8.8") and _public("2001:4860:4860::8888")
    for ip in ("127.0.0.1", "10.0.0.1", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
               "224.0.0.1", "::1", "fe80::1%eth0", "fc00::1", "::ffff:10.0.0.1"):
        assert not _public(ip), ip


def test_allow_list_applies_to_every_redirect(server: ImageServer) -> None:
    config = dataclasses.replace(LOCAL, remote_image_hosts=["127.0.0.1"])
    assert _fetch(server.url("/redirect?to=/cat.png"), config) == PNG
    assert "host localhost is not among the hosts" in _refusal(server.url("/cat.png", host="localhost"), config)
    away = server.url("/redirect?to=" + quote(server.url("/cat.png", host="localhost"), safe=""))
    message = _refusal(away, config)
    assert message.startswith(f"could not fetch image URL {away} (redirected to http://localhost:"), message
    wildcard = dataclasses.replace(LOCAL, remote_image_hosts=["*.example.com", "LOCALHOST"])
    assert _fetch(server.url("/cat.png", host="localhost"), wildcard) == PNG
    assert "is not among the hosts" in _refusal(server.url("/cat.png"), wildcard)
    assert "is not among the hosts" in _refusal("http://example.com/cat.png", wildcard)  # subdomains only


def test_a_remote_video_is_fetched_by_the_same_rules_and_named_a_video(server: ImageServer) -> None:
    mp4 = b"\x00\x00\x00\x18ftypisom" + bytes(64)  # the container signature is all the gateway reads
    with ImageServer({"/clip.mp4": mp4}) as videos:
        assert video_from_url(videos.url("/clip.mp4"), LOCAL, PARAM) == mp4
    with pytest.raises(InvalidArgument) as info:
        video_from_url(server.url("/missing.mp4"), LOCAL, PARAM)
    assert info.value.message.startswith(f"could not fetch video URL {server.url('/missing.mp4')}"), info.value.message
