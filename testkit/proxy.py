"""A fault-injecting HTTP proxy in front of a real S3 server (127.0.0.1 only).

Requests are forwarded byte for byte — the ``Host`` header as the client sent it, so SigV4
signatures stay valid — except ``Expect: 100-continue``, which the proxy answers itself (it is
never signed). Per request, with probability ``FaultPlan.rate`` and a seeded RNG, one fault of
``FaultPlan.mix`` is injected:

=========  ======================================================================  =========
kind       what the client sees                                                    forwarded
=========  ======================================================================  =========
500        ``500 InternalError``                                                   no
503        ``503 ServiceUnavailable``                                              no
409        ``409 ConditionalRequestConflict`` (what AWS answers to overlapping      no
           conditional writes; PUT and POST only)
reset      connection reset before anything is forwarded                          no
truncate   the server's answer cut in half (body, or headers when there is no      yes
           body), then the connection closed
slow       the server's answer, ``slow_s`` late                                   yes
drop       connection reset after the server applied the request: the SDK         yes
           retries a PUT that landed
flip       one byte of the request body flipped on the way (not in the default     yes
           mix; only requests with a body): does anything end to end notice?
=========  ======================================================================  =========

``methods`` and ``key_pattern`` restrict which requests can be faulted (e.g. only PUTs, only
the HEAD key). :attr:`FaultProxy.counts` counts injected faults by kind.

Example::

    with FaultProxy(server.endpoint_url, FaultPlan(rate=0.1, seed=1)) as proxy:
        store = open_store(url, storage_options=server.with_endpoint(proxy.endpoint_url).storage_options())
        ...
        print(proxy.counts)

:class:`ScriptedProxy` is the deterministic sibling for unit tests: instead of a random plan it
applies queued :class:`Fault` s, each once, to the next matching request (one request per
connection), and can strip request headers (an endpoint that ignores ``If-None-Match``/``If-Match``,
like rclone's ``serve s3``)::

    with ScriptedProxy(server.endpoint_url) as proxy:
        proxy.add(Fault("GET", cut_body_after=10))
        store = open_store(url, storage_options=server.storage_options(endpoint_url=proxy.endpoint_url))
"""

from __future__ import annotations

import logging
import random
import re
import socket
import socketserver
import struct
import threading
import time
import urllib.parse
import uuid
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from typing_extensions import Self

logger = logging.getLogger(__name__)

FAULT_KINDS = ("500", "503", "409", "reset", "truncate", "slow", "drop", "flip")
#: Equal weights: every kind of fault about as often as the others. ``flip`` (a damaged request
#: body) is not in the default mix: it models a broken network path, not an S3 answer.
DEFAULT_MIX: Mapping[str, float] = {k: 1.0 for k in FAULT_KINDS if k != "flip"}
#: A request or response larger than this is refused: campaign objects are KiB to a few MiB.
MAX_BODY_BYTES = 512 * 1024 * 1024
#: Idle keep-alive connections and stuck servers are dropped after this long.
SOCKET_TIMEOUT_S = 60.0
#: Connections served at once; more wait. botocore opens at most max_pool_connections each.
MAX_CONNECTIONS = 512

#: S3 answers 409 ConditionalRequestConflict to writes only.
_WRITES = frozenset({"PUT", "POST"})
_ERRORS = {
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "Service Unavailable", "ServiceUnavailable", "Please reduce your request rate."),
    "409": (409, "Conflict", "ConditionalRequestConflict",
            "A conflicting conditional operation is currently in progress against this resource."),
}  # fmt: skip


@dataclass(frozen=True)
class FaultPlan:
    """Which requests get which faults.

    Attributes:
        rate: probability that a matching request is faulted.
        mix: relative weight of each fault kind (kinds absent or 0 never happen).
        methods: HTTP methods that may be faulted (None: all).
        key_pattern: regular expression searched in the decoded request path (None: all).
        slow_s: delay of a ``slow`` response.
        seed: seed of the proxy's RNG.
    """

    rate: float = 0.10
    mix: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    methods: frozenset[str] | None = None
    key_pattern: str | None = None
    slow_s: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.mix) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kind(s) {sorted(unknown)}; known: {FAULT_KINDS}")
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {self.rate}")


OFF = FaultPlan(rate=0.0)


@dataclass(frozen=True)
class Event:
    """One injected fault."""

    kind: str
    method: str
    path: str


class _Closed(Exception):
    """The peer closed the connection."""


def _read_line(f) -> bytes:
    line = f.readline(65537)
    if not line:
        raise _Closed()
    return line


def _read_head(f) -> tuple[bytes, list[bytes]]:
    """First line and header lines (raw, with CRLF) of a request or response."""
    first = _read_line(f)
    while first in (b"\r\n", b"\n"):  # tolerated between messages
        first = _read_line(f)
    headers = []
    while True:
        line = _read_line(f)
        if line in (b"\r\n", b"\n"):
            return first, headers
        headers.append(line)


def _header(headers: list[bytes], name: bytes) -> bytes | None:
    name = name.lower()
    for h in headers:
        k, _, v = h.partition(b":")
        if k.strip().lower() == name:
            return v.strip()
    return None


def _read_body(f, headers: list[bytes], *, until_close: bool) -> bytes:
    """The raw body bytes (chunked framing kept as is)."""
    te = _header(headers, b"transfer-encoding")
    if te is not None and b"chunked" in te.lower():
        out = bytearray()
        while True:
            line = _read_line(f)
            out += line
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    t = _read_line(f)
                    out += t
                    if t in (b"\r\n", b"\n"):
                        return bytes(out)
            if len(out) + size > MAX_BODY_BYTES:
                raise _Closed()
            out += f.read(size + 2)
    cl = _header(headers, b"content-length")
    if cl is not None:
        n = int(cl)
        if n > MAX_BODY_BYTES:
            raise _Closed()
        data = f.read(n)
        if len(data) != n:
            raise _Closed()
        return data
    return f.read(MAX_BODY_BYTES) if until_close else b""


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): the peer sees 'connection reset'."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class LoopbackTCPServer:
    """A threaded TCP server on 127.0.0.1 that hands each connection to :meth:`_handle`; the
    lifecycle (start, stop, context manager, endpoint) shared by the fault proxy and the link
    shaper (testkit/shaper.py)."""

    _server: socketserver.ThreadingTCPServer | None = None
    #: thread name of the accept loop
    _name = "loopback-server"

    @property
    def endpoint_url(self) -> str:
        assert self._server is not None, f"{type(self).__name__} not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def _handle(self, sock: socket.socket) -> None:
        """One accepted connection, on its own thread."""
        raise NotImplementedError

    def start(self) -> Self:
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                owner._handle(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 128

        self._server = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, name=self._name, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FaultProxy(LoopbackTCPServer):
    """The proxy: start with ``with FaultProxy(...)`` or :meth:`start`/:meth:`stop`."""

    _name = "fault-proxy"

    def __init__(self, upstream: str, plan: FaultPlan = OFF):
        u = urllib.parse.urlsplit(upstream)
        if u.scheme != "http" or not u.hostname or not u.port:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = (u.hostname, u.port)
        self._lock = threading.Lock()
        self._plan = plan
        self._rng = random.Random(plan.seed)
        self._pattern = re.compile(plan.key_pattern) if plan.key_pattern else None
        self.counts: Counter[str] = Counter()  # injected faults by kind
        self.by_method: Counter[str] = Counter()  # "kind method", e.g. "drop PUT"
        self.events: list[Event] = []
        self.requests = 0
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._server: socketserver.ThreadingTCPServer | None = None

    # --- configuration ------------------------------------------------------------------

    @property
    def plan(self) -> FaultPlan:
        return self._plan

    def set_plan(self, plan: FaultPlan) -> None:
        """Switch plans (e.g. :data:`OFF` while a campaign sets up); the RNG is re-seeded."""
        with self._lock:
            self._plan = plan
            self._rng = random.Random(plan.seed)
            self._pattern = re.compile(plan.key_pattern) if plan.key_pattern else None

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def _choose(self, method: str, path: str, has_body: bool = False) -> str | None:
        """The fault for this request (None for none), counted; drawn under the lock."""
        with self._lock:
            self.requests += 1
            plan = self._plan
            if plan.rate <= 0.0:
                return None
            if plan.methods is not None and method not in plan.methods:
                return None
            if self._pattern is not None and not self._pattern.search(path):
                return None
            if self._rng.random() >= plan.rate:
                return None
            kinds = [k for k in FAULT_KINDS if plan.mix.get(k, 0) > 0 and (k != "409" or method in _WRITES)]
            if not kinds:
                return None
            kind = self._rng.choices(kinds, weights=[plan.mix[k] for k in kinds])[0]
            if kind == "flip" and not has_body:
                return None
            self.counts[kind] += 1
            self.by_method[f"{kind} {method}"] += 1
            self.events.append(Event(kind, method, path))
            return kind

    # --- lifecycle ----------------------------------------------------------------------

    def _handle(self, sock: socket.socket) -> None:
        with self._slots:
            self._serve(sock)

    # --- one client connection ----------------------------------------------------------

    def _connect(self) -> tuple[socket.socket, object]:
        up = socket.create_connection(self.upstream, timeout=SOCKET_TIMEOUT_S)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return up, up.makefile("rb")

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(SOCKET_TIMEOUT_S)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cf = client.makefile("rb")
        up: socket.socket | None = None
        uf = None
        try:
            while True:
                try:
                    first, headers = _read_head(cf)
                except (_Closed, OSError, ValueError):
                    return
                expect = _header(headers, b"expect")
                if expect is not None and expect.lower() == b"100-continue":
                    # Answer it here (Expect is never signed) so the body comes at once.
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    headers = [h for h in headers if h.partition(b":")[0].strip().lower() != b"expect"]
                try:
                    body = _read_body(cf, headers, until_close=False)
                except (_Closed, OSError, ValueError):
                    return
                parts = first.decode("latin-1").split()
                method, target = (parts[0], parts[1]) if len(parts) >= 2 else ("?", "/")
                path = urllib.parse.unquote(urllib.parse.urlsplit(target).path)
                chunked = b"chunked" in (_header(headers, b"transfer-encoding") or b"").lower()
                kind = self._choose(method, path, has_body=bool(body) and not chunked)
                if kind == "flip":
                    with self._lock:
                        i = self._rng.randrange(len(body))
                        bit = 1 << self._rng.randrange(8)
                    body = body[:i] + bytes([body[i] ^ bit]) + body[i + 1 :]
                if kind in _ERRORS:
                    client.sendall(self._error(kind, method))
                    continue
                if kind == "reset":
                    _reset(client)
                    return
                raw_request = first + b"".join(headers) + b"\r\n" + body
                try:
                    if up is None:
                        up, uf = self._connect()
                    try:
                        up.sendall(raw_request)
                        status, rheaders = _read_head(uf)
                    except (_Closed, ConnectionError):
                        # A kept-alive upstream connection closed in between: once more, fresh.
                        up.close()
                        up, uf = self._connect()
                        up.sendall(raw_request)
                        status, rheaders = _read_head(uf)
                    code = int(status.split()[1])
                    no_body = method == "HEAD" or code in (204, 304) or 100 <= code < 200
                    conn = (_header(rheaders, b"connection") or b"").lower()
                    until_close = (
                        not no_body
                        and _header(rheaders, b"content-length") is None
                        and _header(rheaders, b"transfer-encoding") is None
                    )
                    rbody = b"" if no_body else _read_body(uf, rheaders, until_close=until_close)
                except (OSError, _Closed, ValueError, IndexError) as e:
                    logger.debug("upstream failed for %s %s: %s", method, path, e)
                    _reset(client)
                    return
                head = status + b"".join(rheaders) + b"\r\n"
                if kind == "drop":
                    _reset(client)  # the server applied it; the client never hears
                    return
                if kind == "truncate":
                    if len(rbody) >= 2:
                        client.sendall(head + rbody[: len(rbody) // 2])
                    else:
                        client.sendall(head[: len(head) // 2])
                    client.shutdown(socket.SHUT_RDWR)
                    client.close()
                    return
                if kind == "slow":
                    time.sleep(self._plan.slow_s)
                client.sendall(head + rbody)
                if conn == b"close" or until_close or (_header(headers, b"connection") or b"").lower() == b"close":
                    return
        except OSError:
            return
        finally:
            if up is not None:
                up.close()
            try:
                client.close()
            except OSError:
                pass

    @staticmethod
    def _error(kind: str, method: str) -> bytes:
        status, reason, code, message = _ERRORS[kind]
        rid = uuid.uuid4().hex[:16].upper()
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message><RequestId>{rid}</RequestId></Error>"
        ).encode()
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nx-amz-request-id: {rid}\r\n\r\n"
        ).encode()
        return head if method == "HEAD" else head + body


# --- scripted faults ---------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """What to do to the next request with this method (and path containing ``path_part``)."""

    method: str
    path_part: str = ""
    cut_body_after: int | None = None  # send headers and this many body bytes, then close
    shorten_body_to: int | None = None  # send this many body bytes with a matching Content-Length
    flip_body_byte: int | None = None  # flip the low bit of the body byte at this offset


class ScriptedProxy(LoopbackTCPServer):
    """Forward HTTP/1.1 requests to ``upstream``; apply queued :class:`Fault` s once each."""

    _name = "scripted-proxy"

    def __init__(self, upstream: str, *, strip_request_headers: tuple[str, ...] = ()):
        parts = urllib.parse.urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._strip = {h.lower() for h in strip_request_headers}
        self._faults: deque[Fault] = deque()
        self._lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request seen
        self.applied: list[Fault] = []

    def add(self, *faults: Fault) -> None:
        with self._lock:
            self._faults.extend(faults)

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            self.requests.append((method, path))
            for fault in self._faults:
                if fault.method == method and fault.path_part in path:
                    self._faults.remove(fault)
                    self.applied.append(fault)
                    return fault
        return None

    def _handle(self, sock: socket.socket) -> None:
        sock.settimeout(SOCKET_TIMEOUT_S)
        try:
            with socket.create_connection(self._upstream, timeout=SOCKET_TIMEOUT_S) as upstream:
                f = sock.makefile("rb")
                first, raw_headers = _read_head(f)
                request_line = first.rstrip(b"\r\n")
                headers = [h.rstrip(b"\r\n") for h in raw_headers]
                method, path, _ = request_line.decode("latin-1").split(" ", 2)
                if _header(headers, b"expect") is not None:
                    sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")  # the body is forwarded whole
                body = _read_body(f, raw_headers, until_close=False)  # framing kept as sent
                drop = self._strip | {"connection", "expect"}
                kept = [h for h in headers if h.split(b":", 1)[0].strip().lower().decode("latin-1") not in drop]
                upstream.sendall(b"\r\n".join([request_line, *kept, b"Connection: close", b"", b""]) + body)
                fault = self._take_fault(method, path)
                response = b""
                while chunk := upstream.recv(65536):
                    response += chunk
                sock.sendall(_apply_fault(fault, response))
        except (OSError, _Closed):
            return


def _apply_fault(fault: Fault | None, response: bytes) -> bytes:
    """The bytes to send back for ``response`` (a whole HTTP response) under ``fault``."""
    head, _, body = response.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:")]
    lines.append(b"Connection: close")  # one request per connection: clients must not reuse it
    if fault is not None and fault.flip_body_byte is not None and fault.flip_body_byte < len(body):
        i = fault.flip_body_byte
        body = body[:i] + bytes([body[i] ^ 1]) + body[i + 1 :]
    if fault is not None and fault.shorten_body_to is not None:
        body = body[: fault.shorten_body_to]
        lines = [line for line in lines if not line.lower().startswith(b"content-length:")]
        lines.append(b"Content-Length: %d" % len(body))
    out = b"\r\n".join(lines) + b"\r\n\r\n"
    if fault is not None and fault.cut_body_after is not None:
        return out + body[: fault.cut_body_after]
    return out + body
