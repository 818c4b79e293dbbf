"""Remote image and video URLs: the gateway downloads an http(s) `image_url` (or `video_url`) itself, when the
operator allows it.

Off by default (`gateway.remote_images`): fetching on a client's behalf lets any client make the
gateway connect anywhere it can reach. When on, every URL, and every redirect target, must be
http(s), name an allowed host (`remote_image_hosts`, empty: any) and resolve only to public
addresses (`remote_image_allow_private` lifts that, e.g. for a trusted intranet). The connection
goes to the checked address itself, so a second name lookup cannot answer differently (DNS
rebinding). One download, redirects and name lookups included, ends within `remote_image_timeout_s`
(a watchdog shuts the socket down at the deadline, so a server dripping bytes cannot hold a thread),
and reads at most `max_image_bytes` + 1 bytes. The bytes then go through the same checks as an
inline data URL's (gateway/images.py). Errors name the client's URL and the reason, never the
addresses the gateway resolved or its own exceptions (those go to the log).

    fetch_file("https://cdn.example.com/cat.png", config, "messages[0].content[1]", "image") -> b"\\x89PNG..."
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from services.common.config import GatewayConfig
from services.common.errors import InvalidArgument, PayloadTooLarge

log = logging.getLogger(__name__)

SCHEMES = {"http": 80, "https": 443}  # scheme -> default port
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
CHUNK_BYTES = 64 * 1024
MAX_SHOWN_URL_CHARS = 200  # of a URL quoted back in an error message
USER_AGENT = "tessera-gateway"


@dataclass(frozen=True, slots=True)
class _Target:
    """One URL to GET, its host resolved and checked."""
    url: str
    tls: bool
    host: str
    port: int
    path: str  # path and query: what goes on the request line
    addresses: tuple[tuple[int, tuple], ...]  # (address family, socket address) to connect to, in resolver order


class _FetchError(Exception):
    """Why one download failed, in words fit for the client."""


class _TooLarge(Exception):
    """The body is over max_image_bytes; the message says by how much, as far as it is known."""


def shown(url: str) -> str:
    return url if len(url) <= MAX_SHOWN_URL_CHARS else url[:MAX_SHOWN_URL_CHARS] + "..."


def fetch_file(url: str, config: GatewayConfig, param: str, kind: str) -> bytes:
    """GET `url` (following at most `remote_image_max_redirects` redirects) -> the body's bytes. `kind`:
    "image" or "video", what the client's part holds (the Accept header and the messages say it).
    Over `max_image_bytes` is a 413; any other failure a 400 naming the URL and the reason."""
    deadline = time.monotonic() + config.remote_image_timeout_s
    current = url
    try:
        for _ in range(config.remote_image_max_redirects + 1):
            target = _target(current, config, deadline)
            status, location, body = _get(target, config, deadline, kind)
            if status in REDIRECT_STATUSES and location:
                current = urljoin(current, location)
                continue
            if status != 200:
                raise _FetchError(f"the server answered HTTP {status}")
            return body
        raise _FetchError(f"it redirects more than {config.remote_image_max_redirects} times")
    except _FetchError as exc:
        where = shown(url) if current == url else f"{shown(url)} (redirected to {shown(current)})"
        raise InvalidArgument(f"could not fetch {kind} URL {where}: {exc}", param=param) from None
    except _TooLarge as exc:
        raise PayloadTooLarge(f"the {kind} at {shown(url)} is {exc}; the limit is {config.max_image_bytes}",
                              param=param) from None


def _target(url: str, config: GatewayConfig, deadline: float) -> _Target:
    """Check `url`'s scheme and host against the configuration and resolve it to allowed addresses."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise _FetchError("it is not a valid URL") from None
    scheme, host = parts.scheme.lower(), parts.hostname
    if scheme not in SCHEMES:
        raise _FetchError(f"only http and https URLs are fetched, not {scheme or 'a URL without a scheme'}")
    if not host:
        raise _FetchError("it names no host")
    if not _host_allowed(host, config.remote_image_hosts):
        raise _FetchError(f"host {host} is not among the hosts this gateway fetches from")
    port = port or SCHEMES[scheme]
    infos = _resolve(host, port, deadline, config.remote_image_timeout_s)
    addresses = tuple(dict.fromkeys((family, sockaddr) for family, _, _, _, sockaddr in infos))
    if not config.remote_image_allow_private and not all(_public(sockaddr[0]) for _, sockaddr in addresses):
        raise _FetchError(f"host {host} resolves to a loopback, private, link-local or otherwise non-public "
                          "address; this gateway does not fetch from those")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target(url, scheme == "https", host, port, path, addresses)


def _host_allowed(host: str, allowed: list[str]) -> bool:
    """`host` (lower case, as urlsplit gives it) against the allow-list: exact names, or "*.example.com"
    for any subdomain of example.com; an empty list allows every host."""
    if not allowed:
        return True
    entries = [entry.strip().lower().strip("[]") for entry in allowed]  # "[::1]" names the host ::1
    return any(host == entry or (entry.startswith("*.") and host.endswith(entry[1:])) for entry in entries)


def _public(ip: str) -> bool:
    address = ipaddress.ip_address(ip.partition("%")[0])  # an IPv6 scope ("fe80::1%eth0") says nothing here
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is loopback
    return address.is_global and not address.is_multicast


def _resolve(host: str, port: int, deadline: float, timeout_s: float) -> list[tuple]:
    """getaddrinfo, which takes no timeout, in a thread we stop waiting for at the deadline."""
    result: list = []

    def lookup() -> None:
        try:
            result.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            result.append(exc)
    thread = threading.Thread(target=lookup, name="image-url-lookup", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if not result:
        raise _FetchError(f"timed out after {timeout_s:g} s (looking up its host)")
    if isinstance(result[0], OSError) or not result[0]:
        raise _FetchError(f"its host {host} could not be resolved")
    return result[0]


class _PinnedConnection(http.client.HTTPConnection):
    """An HTTP(S) connection to `target`'s checked addresses, never to a fresh lookup of its name
    (TLS still verifies the certificate against the host name). `cut` shuts its socket down from
    another thread, whatever read or write it is blocked in, and refuses to open one afterwards."""

    def __init__(self, target: _Target, timeout: float) -> None:
        super().__init__(target.host, target.port, timeout=timeout)
        self.default_port = SCHEMES["https" if target.tls else "http"]  # the Host header omits it
        self._target = target
        self._lock = threading.Lock()
        self._cut = False
        # Our own reference: http.client drops `sock` once a response that ends the connection
        # starts, while the response goes on reading from it.
        self._socket: socket.socket | None = None

    @property
    def is_cut(self) -> bool:
        return self._cut

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            if self._socket is not None:
                try:
                    self._socket.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def connect(self) -> None:
        error: OSError | None = None
        for family, address in self._target.addresses:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                self._hold(sock)
                sock.settimeout(self.timeout)
                sock.connect(address)
                break
            except OSError as exc:
                sock.close()
                error = exc
        else:
            raise error or OSError("no address to connect to")
        if self._target.tls:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host,
                                                             do_handshake_on_connect=False)
            self._hold(sock)
            sock.do_handshake()
        self.sock = sock

    def _hold(self, sock: socket.socket) -> None:
        with self._lock:
            if self._cut:
                raise TimeoutError
            self._socket = sock


def _get(target: _Target, config: GatewayConfig, deadline: float, kind: str) -> tuple[int, str | None, bytes]:
    """One GET -> (status, Location header, body); the body is read only for a 200."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _FetchError(f"timed out after {config.remote_image_timeout_s:g} s")
    connection = _PinnedConnection(target, timeout=remaining)
    watchdog = threading.Timer(remaining, connection.cut)  # the deadline holds whatever the server does
    watchdog.daemon = True
    watchdog.start()
    try:
        connection.request("GET", target.path, headers={"User-Agent": USER_AGENT, "Accept": f"{kind}/*"})
        with connection.getresponse() as response:
            if response.status != 200:
                return response.status, response.getheader("Location"), b""
            body = _read_body(response, config.max_image_bytes)
        if connection.is_cut:  # a body without a length just ends where the cut came
            raise TimeoutError
        return 200, None, body
    except (_FetchError, _TooLarge):
        raise
    except Exception as exc:
        if isinstance(exc, TimeoutError) or connection.is_cut:
            raise _FetchError(f"timed out after {config.remote_image_timeout_s:g} s") from None
        log.info("%s URL %s: %s: %s", kind, shown(target.url), type(exc).__name__, exc)
        raise _FetchError(_reason(exc)) from None
    finally:
        watchdog.cancel()
        connection.close()


def _read_body(response: http.client.HTTPResponse, limit: int) -> bytes:
    length = response.getheader("Content-Length", "")
    if length.isdigit() and int(length) > limit:
        raise _TooLarge(f"{int(length)} bytes")
    body = bytearray()
    while len(body) <= limit:
        chunk = response.read(min(CHUNK_BYTES, limit + 1 - len(body)))
        if not chunk:
            return bytes(body)
        body += chunk
    raise _TooLarge(f"over {limit} bytes")


def _reason(exc: Exception) -> str:
    """A failed connection, in words that do not expose the gateway's network."""
    if isinstance(exc, http.client.InvalidURL):  # characters a request line cannot carry
        return "it is not a valid URL"
    if isinstance(exc, ConnectionRefusedError):
        return "the connection was refused"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return "the server's TLS certificate could not be verified"
    if isinstance(exc, ssl.SSLError):
        return "the TLS handshake failed"
    if isinstance(exc, (http.client.HTTPException, ConnectionResetError)):
        return "the server's answer was cut short or is not valid HTTP"
    return "the connection failed"
