"""A small JSON-over-HTTP client for the engines' control endpoints (vLLM, SGLang).

Standard library only: the rollout side talks to a few endpoints of a server on the same host or
network, one request at a time, and must not pull an HTTP stack into ``deltastore``'s
dependencies. Proxies from the environment (``HTTP_PROXY``) are not used: these are an engine's
control endpoints, which a proxy has no business seeing, and a loopback URL must stay loopback.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Seconds a control request may take by default. An engine's update call waits for the
#: requests it is running to finish (SGLang's writer lock), so this is generous.
DEFAULT_TIMEOUT_S = 600.0
#: The most bytes of a reply read: control replies are small, and a hostile or broken server
#: must not make the sidecar buffer gigabytes.
MAX_REPLY_BYTES = 16 << 20


@dataclass(frozen=True)
class Reply:
    """An HTTP reply: its status and its body (parsed JSON, else the text; None when empty)."""

    status: int
    body: Any

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def describe(self) -> str:
        """``HTTP <status>: <body>`` (the body cut short), for error messages."""
        text = self.body if isinstance(self.body, str) else json.dumps(self.body)
        return f"HTTP {self.status}: {text[:500]}"


class JSONClient:
    """JSON requests to ``base_url`` (``http://host:port``).

    Args:
        base_url: the server's URL.
        timeout_s: seconds per request.
        api_key: sent as ``Authorization: Bearer <key>`` (vLLM ``--api-key``, SGLang ``--api-key``).
    """

    def __init__(self, base_url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, api_key: str | None = None):
        parsed = urllib.parse.urlparse(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"an engine URL is http://host:port or https://host:port, not {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def request(self, method: str, path: str, body: Any = None, *, query: Mapping[str, Any] | None = None) -> Reply:
        """Send one request; an HTTP error status is a :class:`Reply` too.

        Raises:
            OSError: the server could not be reached or the connection broke (``URLError``,
                ``TimeoutError``).
        """
        status, raw = self.raw(method, path, body, query=query)
        return Reply(status, _parse(raw))

    def raw(self, method: str, path: str, body: Any = None, *,
            query: Mapping[str, Any] | None = None) -> tuple[int, bytes]:
        """One request: its status and its body's bytes (at most ``MAX_REPLY_BYTES``); an HTTP
        error status is an answer too.

        Raises:
            OSError: the server could not be reached, the connection broke, or the answer was
                garbled or cut short (``ConnectionError``): as good as no answer.
        """
        url = self.base_url + path
        if query:
            url += "?" + urllib.parse.urlencode({k: _query_value(v) for k, v in query.items()})
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method, headers=self._headers)
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                return resp.status, resp.read(MAX_REPLY_BYTES)
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.read(MAX_REPLY_BYTES)
        except http.client.HTTPException as e:
            raise ConnectionError(f"{self.base_url}: {method} {path}: {type(e).__name__}: {e}") from e

    def post(self, path: str, body: Any = None, *, query: Mapping[str, Any] | None = None) -> Reply:
        return self.request("POST", path, {} if body is None else body, query=query)

    def get(self, path: str) -> Reply:
        return self.request("GET", path)


def _query_value(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def _parse(raw: bytes) -> Any:
    if not raw:
        return None
    text = raw.decode("utf-8", "replace")
    try:
        return json.loads(text)
    except ValueError:
        return text
