"""Who may drive the server: an API key, the Host and Origin a request carries, and its content type.

A server on loopback is still reachable from a web page the user opens: a cross-site POST (a "simple"
request: ``text/plain``, no preflight) or DNS rebinding (a page on ``attacker.example`` whose name then
resolves to 127.0.0.1, so the browser treats the server as that page's own origin). `RequestGuard`, an ASGI
middleware (Starlette's extension point), refuses before any route runs:

- a Host header that is not one of the server's names (421): what DNS rebinding cannot forge;
- a foreign ``Origin`` (403): a page of another site (its own origin, and ``--allowed-origins``, pass);
- without ``Authorization: Bearer <key>`` when the server has an API key (401; ``/health`` stays open, as
  vLLM's does, for load balancers);
- a POST whose body is not declared ``application/json`` (415): a browser cannot send that cross-site
  without a CORS preflight, which this server does not grant unless ``--allowed-origins`` says so.

Refusals are JSON in OpenAI's error shape and counted in ``mars_requests_total`` (outcome ``unauthorized``
or ``refused``); the key is compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from mars_hf.serving.protocol import error_body

logger = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("", "0.0.0.0", "::")
OPEN_PATHS = ("/health",)  # answered without the API key (load balancers' probes)


@dataclass
class SecurityConfig:
    """Operator settings of the guard (``mars-hf serve --api-key/--allowed-hosts/--allowed-origins``)."""

    api_key: str | None = field(
        default=None,
        repr=False,  # never in a log line or a traceback's locals
        metadata={"help": "Clients must send `Authorization: Bearer <key>` (env MARS_HF_API_KEY)."},
    )
    allowed_hosts: tuple[str, ...] = field(
        default=(),
        metadata={"help": "Host names accepted besides loopback's and the bound address ('*': any)."},
    )
    allowed_origins: tuple[str, ...] = field(
        default=(),
        metadata={"help": "Browser origins (scheme://host[:port]) allowed to call the server ('*': any)."},
    )

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError(
                "`api_key` (--api-key / MARS_HF_API_KEY) is empty; give a key or leave it unset."
            )
        self.allowed_hosts = tuple(_host_name(h) if h != "*" else h for h in self.allowed_hosts)
        self.allowed_origins = tuple(o.rstrip("/").lower() for o in self.allowed_origins)
        for origin in self.allowed_origins:
            parts = urlsplit(origin)
            if origin != "*" and (parts.scheme not in ("http", "https") or not parts.hostname):
                raise ValueError(
                    f"--allowed-origins entry {origin!r} is not an origin; write it as scheme://host[:port], "
                    "e.g. http://localhost:3000 (or '*')."
                )


def _host_name(host: str) -> str:
    """``host`` without port or IPv6 brackets, lower case (``[::1]:8000`` → ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        return host.split(":", 1)[0]
    return host


def is_loopback(host: str) -> bool:
    name = _host_name(host)
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def bind_warnings(host: str, security: SecurityConfig) -> list[str]:
    """What to tell the operator about binding ``host`` with ``security`` (nothing for loopback)."""
    if is_loopback(host):
        return []
    warnings = []
    if not security.api_key:
        warnings.append(
            f"Serving on {host}, reachable from other machines, without an API key: anyone who can reach it can "
            "use it. Set --api-key (or MARS_HF_API_KEY), or bind 127.0.0.1."
        )
    if _host_name(host) in WILDCARD_BINDS and not security.allowed_hosts:
        warnings.append(
            f"Bound to {host} without --allowed-hosts: requests are answered only when their Host header is one "
            f"of {list(LOOPBACK_NAMES)}; add --allowed-hosts with the names or addresses clients use."
        )
    return warnings


class RequestGuard:
    """ASGI middleware: Host, Origin, API key and content type checked before any route (see the module)."""

    def __init__(self, app, *, security: SecurityConfig, bind_host: str = "127.0.0.1", metrics=None):
        self.app = app
        self.api_key = security.api_key.encode() if security.api_key else None
        names = set(LOOPBACK_NAMES) | set(security.allowed_hosts)
        bound = _host_name(bind_host)
        if bound not in WILDCARD_BINDS:
            names.add(bound)
        self.any_host = "*" in names
        self.hosts = frozenset(names - {"*"})
        self.any_origin = "*" in security.allowed_origins
        self.origins = frozenset(security.allowed_origins)
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, message, code, outcome = refusal
        if self.metrics is not None:
            self.metrics.requests.labels(outcome).inc()
        headers = [(b"content-type", b"application/json")]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        body = json.dumps(error_body(message, status, code)).encode()
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _refusal(self, scope) -> tuple[int, str, str, str] | None:
        """``(status, message, code, metrics outcome)`` of a refused request; None to let it through."""
        headers = {}
        for key, value in scope.get("headers", ()):
            headers.setdefault(key.decode("latin-1").lower(), value.decode("latin-1"))
        host = headers.get("host")
        if not self.any_host and (host is None or _host_name(host) not in self.hosts):
            return (
                421,
                f"This server does not answer to the Host {host!r}; it answers to {sorted(self.hosts)}. Start it "
                "with --allowed-hosts NAME for the name clients use (a check against DNS rebinding).",
                "invalid_host",
                "refused",
            )
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, host or "", scope):
            return (
                403,
                f"Requests from the web origin {origin!r} are not allowed (a cross-site request); start the server "
                "with --allowed-origins ORIGIN to let pages of that origin call it.",
                "forbidden_origin",
                "refused",
            )
        method = scope.get("method", "GET")
        if method == "OPTIONS" and "access-control-request-method" in headers:
            return None  # a CORS preflight of an allowed origin: answered by the CORS middleware
        path = scope.get("path", "")
        if self.api_key is not None and path not in OPEN_PATHS and not self._authorized(headers):
            return (
                401,
                "Missing or wrong API key: send the header `Authorization: Bearer <key>` with the key this "
                "server was started with (--api-key / MARS_HF_API_KEY).",
                "invalid_api_key",
                "unauthorized",
            )
        if method == "POST":
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                return (
                    415,
                    f"The request body must be JSON, sent with `Content-Type: application/json` (got "
                    f"{media or 'no content type'!r}).",
                    "unsupported_media_type",
                    "bad_request",
                )
        return None

    def _origin_allowed(self, origin: str, host: str, scope) -> bool:
        """The server's own origin (same-origin requests carry one too), or one of ``--allowed-origins``."""
        origin = origin.rstrip("/").lower()
        if self.any_origin or origin in self.origins:
            return True
        scheme = scope.get("scheme", "http")
        return origin == f"{scheme}://{host.lower()}"

    def _authorized(self, headers: dict) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode(), self.api_key)
