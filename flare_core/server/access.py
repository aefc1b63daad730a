"""Which host names and browser origins may reach the server.

A server on a loopback address is still reachable from any web page the user opens: through DNS
rebinding (a name the page controls resolves to 127.0.0.1, and the browser sends that name as
`Host`) and through cross-site requests (a page POSTs to http://127.0.0.1:8000; with a "simple"
content type no preflight asks first). Ollama closed the same holes the same way:
- bound to a loopback address, only loopback names are accepted as `Host` (localhost,
  *.localhost, 127.0.0.0/8, ::1) besides the configured `allowed_hosts`; bound elsewhere, any
  `Host` unless `allowed_hosts` is configured;
- a request that carries `Origin` is served only for a loopback origin or a configured
  `allowed_origins` entry ("*" for any), and only those get CORS preflight answers and headers;
- bodies must be `application/json` (checked with the other body headers, see `app`), which a
  page cannot send cross-site without a preflight.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

# What a preflight may ask for: the methods the API routes take, and the request headers of the
# OpenAI, Anthropic and Ollama clients (the key headers included).
PREFLIGHT_METHODS = "GET, POST, OPTIONS"
PREFLIGHT_MAX_AGE_S = 600


def is_loopback_name(name: str) -> bool:
    """localhost, a *.localhost name (RFC 6761), or a loopback IP address."""
    name = name.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a `Host` header, without its port ("[::1]:8000" -> "::1")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def origin_key(origin: str) -> str:
    """An origin as compared: scheme://host[:port], lower case, no trailing slash."""
    return origin.strip().lower().rstrip("/")


@dataclass(frozen=True)
class Access:
    restrict_hosts: bool  # whether `Host` is checked at all
    hosts: frozenset[str]  # configured names besides the loopback ones ("*": any)
    origins: frozenset[str]  # configured origins besides the loopback ones (origin_key; "*": any)

    @classmethod
    def of(cls, bound_host: str, allowed_hosts: Iterable[str], allowed_origins: Iterable[str]) -> Access:
        hosts = frozenset(host_name(h) if h != "*" else h for h in allowed_hosts)
        return cls(restrict_hosts="*" not in hosts and (is_loopback_name(bound_host) or bool(hosts)),
                   hosts=hosts, origins=frozenset(origin_key(o) for o in allowed_origins))

    def host_problem(self, header: str | None) -> str | None:
        """Why a request with this `Host` header is refused, or None. A request without one
        (HTTP/1.0) comes from no browser and is served."""
        if not self.restrict_hosts or header is None:
            return None
        name = host_name(header)
        if is_loopback_name(name) or name in self.hosts:
            return None
        return (f"Host {header[:80]!r} is not allowed: this server answers loopback names only (localhost, "
                f"127.0.0.1, ::1); to serve another name add it with --allowed-hosts (or [server] allowed_hosts)")

    def origin_allowed(self, origin: str) -> bool:
        key = origin_key(origin)
        if "*" in self.origins or key in self.origins:
            return True
        parts = urlsplit(key)
        return parts.scheme in ("http", "https") and parts.hostname is not None and is_loopback_name(parts.hostname)

    def refusal(self, headers: Mapping[str, str]) -> tuple[str, str] | None:
        """Why a request with these headers is refused (the header, the message), or None: its
        Host name, then its Origin."""
        problem = self.host_problem(headers.get("Host"))
        if problem is not None:
            return "Host", problem
        origin = headers.get("Origin")
        if origin is not None and not self.origin_allowed(origin):
            return "Origin", (f"Origin {origin[:80]!r} is not allowed: browser pages are served from loopback "
                              f"origins only; to serve a page from another origin add it with --allowed-origins "
                              f"(or [server] allowed_origins)")
        return None
