"""testkit.shaper.LinkShaper against its own settings, over a real HTTP server on 127.0.0.1:
a transfer of N bytes at B bytes/s takes about N/B (both directions), an RTT is added per
request and per new connection, loss caps one connection at the Mathis rate, resets happen at
their rate, and the bytes arrive unchanged."""

from __future__ import annotations

import http.client
import http.server
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from testkit.shaper import MSS_BYTES, Link, LinkShaper

PAYLOAD = bytes(range(256)) * 4096  # 1 MiB, not compressible to anything a proxy could fake


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: requests on one connection

    def do_GET(self) -> None:
        n = int(self.path.strip("/") or 0)
        self.send_response(200)
        self.send_header("Content-Length", str(n))
        self.end_headers()
        self.wfile.write(PAYLOAD[:n])

    def do_PUT(self) -> None:
        n = int(self.headers["Content-Length"])
        got = self.rfile.read(n)
        body = str(len(got)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _Upstream(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        # the shaper resets connections on purpose (test_resets_happen_at_their_rate): a reset
        # is not worth the traceback socketserver prints for it; anything else still is
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture
def upstream() -> Iterator[str]:
    srv = _Upstream(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _conn(shaper: LinkShaper) -> http.client.HTTPConnection:
    port = int(shaper.endpoint_url.rsplit(":", 1)[1])
    return http.client.HTTPConnection("127.0.0.1", port, timeout=30)


def _get(c: http.client.HTTPConnection, n: int) -> tuple[bytes, float]:
    t = time.monotonic()
    c.request("GET", f"/{n}")
    r = c.getresponse()
    body = r.read()
    return body, time.monotonic() - t


def test_bandwidth_down_and_up_take_n_over_b(upstream: str) -> None:
    rate = 2e6
    with LinkShaper(upstream, Link(bytes_per_s=rate)) as shaper:
        c = _conn(shaper)
        _get(c, 10)  # connection open
        body, dt = _get(c, len(PAYLOAD))
        assert body == PAYLOAD
        want = len(PAYLOAD) / rate
        assert 0.85 * want <= dt <= 1.3 * want + 0.1, (dt, want)
        t = time.monotonic()
        c.request("PUT", "/x", body=PAYLOAD)
        assert c.getresponse().read() == str(len(PAYLOAD)).encode()
        dt = time.monotonic() - t
        assert 0.85 * want <= dt <= 1.3 * want + 0.1, (dt, want)
        assert shaper.bytes_down >= len(PAYLOAD) and shaper.bytes_up >= len(PAYLOAD)


def test_rtt_per_request_and_per_connection(upstream: str) -> None:
    rtt = 0.15
    with LinkShaper(upstream, Link(rtt_s=rtt)) as shaper:
        c = _conn(shaper)
        t = time.monotonic()
        _get(c, 100)  # handshake + request/response
        first = time.monotonic() - t
        _, again = _get(c, 100)  # same connection: one RTT
        assert 1.9 * rtt <= first <= 2 * rtt + 0.15, first
        assert 0.95 * rtt <= again <= rtt + 0.1, again
        assert shaper.connections == 1


def test_loss_caps_one_connection_at_the_mathis_rate(upstream: str) -> None:
    link = Link(rtt_s=0.02, loss=0.01, seed=3)
    cap = link.per_connection_bytes_per_s
    assert cap is not None and cap == pytest.approx(MSS_BYTES / 0.02 * 1.5**0.5 / 0.1)
    with LinkShaper(upstream, link) as shaper:
        c = _conn(shaper)
        body, dt = _get(c, len(PAYLOAD))
        assert body == PAYLOAD  # lost packets are retransmitted: nothing is missing
        assert dt >= 0.85 * len(PAYLOAD) / cap, (dt, cap)
        packets = len(PAYLOAD) // MSS_BYTES
        assert 0.2 * 0.01 * packets <= shaper.lost_packets <= 3 * 0.01 * packets + 5


def test_resets_happen_at_their_rate(upstream: str) -> None:
    with LinkShaper(upstream, Link(reset_rate=1.0)) as shaper, pytest.raises((ConnectionError, http.client.HTTPException)):
        _get(_conn(shaper), 10)
    failed = 0
    with LinkShaper(upstream, Link(reset_rate=0.3, seed=7)) as shaper:
        for _ in range(40):
            try:
                body, _ = _get(_conn(shaper), 10)
                assert body == PAYLOAD[:10]
            except (ConnectionError, http.client.HTTPException):
                failed += 1
        assert failed == shaper.resets
        assert 4 <= failed <= 22, failed
    with LinkShaper(upstream, Link()) as shaper:
        assert all(_get(_conn(shaper), 10)[0] == PAYLOAD[:10] for _ in range(10))
        assert shaper.resets == 0


def test_deltastore_through_a_lossy_resetting_link_stays_bit_exact(moto_s3_url) -> None:
    """A far worker on real S3 (moto) behind the shaper: resets make botocore retry, loss slows
    it; every version arrives bit-exact."""
    import torch

    from deltastore import Publisher, Subscriber
    from deltastore.write.policy import WriterPolicy
    from testkit.tensors import assert_bits_equal, small_state, snapshot

    url, near = moto_s3_url.url, dict(moto_s3_url.storage_options)
    link = Link(rtt_s=0.01, loss=0.01, reset_rate=0.05, seed=5)
    with LinkShaper(near["endpoint_url"], link) as shaper:
        far = {**near, "endpoint_url": shaper.endpoint_url, "retries": 8}
        state = small_state(rows=64)
        with Publisher(url, storage_options=near, writer_policy=WriterPolicy(threads=2)) as pub, Subscriber(url, storage_options=far, threads=2) as sub:
            pub.publish(state)
            held = sub.pull()
            for i in range(3):
                state = {n: (t + (i + 1)).to(t.dtype) if t.is_floating_point() else t + 1 for n, t in state.items()}
                pub.publish(state)
                sub.pull_into(held)
                assert_bits_equal(held, snapshot(state), f"version {i + 2}")
        assert shaper.bytes_down > 0 and all(isinstance(t, torch.Tensor) for t in held.values())
