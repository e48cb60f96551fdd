"""A tiny fault-injecting HTTP proxy for storage tests (one request per connection).

It listens on 127.0.0.1, forwards each request to one upstream S3 server and the answer back,
and can, per request, cut the response body after N bytes (connection closed early), shorten it
while keeping Content-Length consistent (a server returning fewer bytes than asked), or strip
request headers (an endpoint that ignores ``If-None-Match``/``If-Match``, like rclone's
``serve s3``). Deliberately small: the campaign proxy lives elsewhere.

Example::

    with FaultProxy(server.endpoint_url) as proxy:
        proxy.add(Fault("GET", cut_body_after=10))
        store = open_store(url, storage_options=server.storage_options(endpoint_url=proxy.url))
"""

from __future__ import annotations

import socket
import threading
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

#: Socket timeout for both legs: a stuck test fails instead of hanging.
SOCKET_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Fault:
    """What to do to the next request with this method (and path containing ``path_part``)."""

    method: str
    path_part: str = ""
    cut_body_after: int | None = None  # send headers and this many body bytes, then close
    shorten_body_to: int | None = None  # send this many body bytes with a matching Content-Length
    flip_body_byte: int | None = None  # flip the low bit of the body byte at this offset


class FaultProxy:
    """Forward HTTP/1.1 requests to ``upstream``; apply queued :class:`Fault` s once each."""

    def __init__(self, upstream: str, *, strip_request_headers: tuple[str, ...] = ()):
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._strip = {h.lower() for h in strip_request_headers}
        self._faults: deque[Fault] = deque()
        self._lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request seen
        self.applied: list[Fault] = []
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def add(self, *faults: Fault) -> None:
        with self._lock:
            self._faults.extend(faults)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            self.requests.append((method, path))
            for fault in self._faults:
                if fault.method == method and fault.path_part in path:
                    self._faults.remove(fault)
                    self.applied.append(fault)
                    return fault
        return None

    def _handle(self, client: socket.socket) -> None:
        client.settimeout(SOCKET_TIMEOUT_S)
        try:
            with client, socket.create_connection(self._upstream, timeout=SOCKET_TIMEOUT_S) as upstream:
                head, rest = _read_head(client)
                if head is None:
                    return
                lines = head.split(b"\r\n")
                method, path, _ = lines[0].decode("latin-1").split(" ", 2)
                headers = [line for line in lines[1:] if line]
                length = _content_length(headers)
                if any(h.lower().startswith(b"expect:") for h in headers):
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")  # we forward the body whole
                body = rest
                while len(body) < length:
                    chunk = client.recv(65536)
                    if not chunk:
                        return
                    body += chunk
                kept = [
                    h for h in headers
                    if h.split(b":", 1)[0].strip().lower().decode("latin-1") not in self._strip | {"connection", "expect"}
                ]  # fmt: skip
                upstream.sendall(b"\r\n".join([lines[0], *kept, b"Connection: close", b"", b""]) + body)
                fault = self._take_fault(method, path)
                response = b""
                while True:
                    chunk = upstream.recv(65536)
                    if not chunk:
                        break
                    response += chunk
                client.sendall(_apply(fault, response))
        except OSError:
            return


def _read_head(sock: socket.socket) -> tuple[bytes | None, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _content_length(headers: list[bytes]) -> int:
    for h in headers:
        name, _, value = h.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


def _apply(fault: Fault | None, response: bytes) -> bytes:
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
