"""A link-shaping TCP proxy (127.0.0.1 only): a far link in front of a real local server.

This kernel has no netem qdisc, so the link is modelled in user space, per direction:

- **latency**: every byte arrives ``rtt_s / 2`` after it was sent (a delay line), and opening a
  connection costs one RTT (the TCP handshake) before the first byte is forwarded;
- **bandwidth**: one token bucket per direction shared by every connection (the link), of
  ``bytes_per_s`` with a burst of :data:`BURST_BYTES`;
- **loss**: each :data:`MSS_BYTES` packet is lost with probability ``loss``; a lost packet is
  retransmitted one RTT later and, as TCP keeps bytes in order, holds back what follows it
  (head-of-line). With ``loss > 0`` each connection is also capped at the rate a Reno-style TCP
  sustains at that loss and RTT (Mathis et al. 1997: ``MSS / RTT · sqrt(3/2) / sqrt(loss)``),
  which is what makes one stream slow on a lossy far link and many streams fast;
- **resets**: with probability ``reset_rate`` per client write (about one per request), the
  connection is reset instead of forwarded.

Bytes are forwarded unchanged (SigV4 signatures stay valid). :attr:`LinkShaper.bytes_up` and
``bytes_down`` count what crossed the link.

Example::

    with LinkShaper(server.endpoint_url, Link(bytes_per_s=12.5e6, rtt_s=0.08, loss=0.001)) as link:
        opts = server.with_endpoint(link.endpoint_url).storage_options()
"""

from __future__ import annotations

import logging
import math
import queue
import random
import socket
import socketserver
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass

from testkit.proxy import LoopbackTCPServer

logger = logging.getLogger(__name__)

#: Bytes read from a socket at a time: small enough that pacing is smooth at 100 Mbit/s
#: (16 KiB is 1.3 ms there), large enough that Python's per-read cost stays negligible.
READ_BYTES = 16 * 1024
#: Token-bucket depth: a link forwards a burst this large at once (a few packets' worth, as a
#: switch's queue does), then at its rate.
BURST_BYTES = 64 * 1024
#: TCP segment payload on an Ethernet path (1500 − IP and TCP headers with timestamps).
MSS_BYTES = 1448
#: Idle connections are dropped after this long.
SOCKET_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Link:
    """A simulated link.

    Attributes:
        bytes_per_s: bandwidth per direction (None: unlimited). 100 Mbit/s is 12.5e6.
        rtt_s: round-trip time added (half each way), plus one RTT per new connection.
        loss: probability that a packet of MSS_BYTES is lost (retransmitted one RTT later).
        reset_rate: probability that a client write (about one per request) resets the
            connection instead of being forwarded.
        seed: seed of the loss and reset RNG.
    """

    bytes_per_s: float | None = None
    rtt_s: float = 0.0
    loss: float = 0.0
    reset_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.bytes_per_s is not None and self.bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be positive, got {self.bytes_per_s}")
        if self.rtt_s < 0 or not 0 <= self.loss < 1 or not 0 <= self.reset_rate <= 1:
            raise ValueError(f"invalid link {self}")

    @property
    def per_connection_bytes_per_s(self) -> float | None:
        """The rate one TCP connection sustains at this loss and RTT (Mathis), None: no cap."""
        if self.loss <= 0 or self.rtt_s <= 0:
            return None
        return MSS_BYTES / self.rtt_s * math.sqrt(1.5) / math.sqrt(self.loss)


class _Pacer:
    """A token bucket as a virtual clock: ``reserve(n)`` returns when ``n`` bytes have left."""

    def __init__(self, rate: float | None, burst: int = BURST_BYTES):
        self.rate = rate
        self.burst_s = burst / rate if rate else 0.0
        self.free_at = 0.0  # when the link has sent everything reserved so far
        self.lock = threading.Lock()

    def reserve(self, n: int) -> float:
        """Reserve ``n`` bytes of link time; the time they have been sent (may be in the past)."""
        if not self.rate:
            return time.monotonic()
        with self.lock:
            now = time.monotonic()
            start = max(self.free_at, now - self.burst_s)  # an idle link has a full bucket
            self.free_at = start + n / self.rate
            return self.free_at


def _sleep_until(t: float) -> None:
    d = t - time.monotonic()
    if d > 0:
        time.sleep(d)


def _reset(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


class LinkShaper(LoopbackTCPServer):
    """A TCP proxy on 127.0.0.1 that shapes traffic to ``upstream`` (``http://host:port``)
    like :class:`Link` says. Use as a context manager; ``endpoint_url`` is where to connect."""

    _name = "link-shaper"

    def __init__(self, upstream: str, link: Link):
        u = urllib.parse.urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.link = link
        self._up = _Pacer(link.bytes_per_s)
        self._down = _Pacer(link.bytes_per_s)
        self._rng = random.Random(link.seed)
        self._rng_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections = 0
        self.resets = 0
        self.lost_packets = 0
        self._server: socketserver.ThreadingTCPServer | None = None

    def _handle(self, sock: socket.socket) -> None:
        self._serve(sock)

    def _chance(self, p: float) -> bool:
        if p <= 0:
            return False
        with self._rng_lock:
            return self._rng.random() < p

    def _lost(self, n: int) -> int:
        """Packets lost among the ``n`` bytes' packets."""
        if self.link.loss <= 0:
            return 0
        with self._rng_lock:
            return sum(self._rng.random() < self.link.loss for _ in range(-(-n // MSS_BYTES)))

    def _serve(self, client: socket.socket) -> None:
        with self._count_lock:
            self.connections += 1
        time.sleep(self.link.rtt_s)  # the handshake: SYN, SYN-ACK
        try:
            server = socket.create_connection(self.upstream, timeout=SOCKET_TIMEOUT_S)
        except OSError:
            _reset(client)
            return
        client.settimeout(SOCKET_TIMEOUT_S)
        closed = threading.Event()
        t = threading.Thread(target=self._pump, args=(server, client, self._down, False, closed), daemon=True)
        t.start()
        self._pump(client, server, self._up, True, closed)
        t.join()
        for s in (client, server):
            try:
                s.close()
            except OSError:
                pass

    def _pump(self, src: socket.socket, dst: socket.socket, link: _Pacer, upward: bool, closed: threading.Event) -> None:
        """Forward ``src`` → ``dst`` through the link: pace, then deliver half an RTT later
        (later still for lost packets), in order, from a second thread."""
        one_way = self.link.rtt_s / 2
        conn = _Pacer(self.link.per_connection_bytes_per_s)
        line: queue.Queue[tuple[float, bytes] | None] = queue.Queue()

        def deliver() -> None:
            while True:
                item = line.get()
                if item is None:
                    break
                at, data = item
                _sleep_until(at)
                try:
                    dst.sendall(data)
                except OSError:
                    closed.set()
                    break
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        writer = threading.Thread(target=deliver, daemon=True)
        writer.start()
        last = 0.0
        try:
            while not closed.is_set():
                try:
                    data = src.recv(READ_BYTES)
                except OSError:
                    break
                if not data:
                    break
                if upward and self._chance(self.link.reset_rate):
                    with self._count_lock:
                        self.resets += 1
                    closed.set()
                    _reset(src)
                    _reset(dst)
                    break
                sent = max(link.reserve(len(data)), conn.reserve(len(data)))
                _sleep_until(sent)  # the sender is held back while the link is busy
                lost = self._lost(len(data))
                at = max(last, sent + one_way + lost * self.link.rtt_s)
                last = at
                with self._count_lock:
                    if upward:
                        self.bytes_up += len(data)
                    else:
                        self.bytes_down += len(data)
                    self.lost_packets += lost
                line.put((at, data))
        finally:
            line.put(None)
            writer.join()
