"""Request bodies being received: how many at once, from whom, and how slowly.

A body in transit holds a connection and a slot of its own (never an ingress reservation), so
clients that stall their uploads cannot take what generation requests need. Three bounds keep
them from taking every upload slot either:
- per client: at most `uploads_per_client` bodies arriving at once from one address (an IPv6
  client by its /64, the block one host is given), so one client's stalled uploads leave the
  other clients' slots free;
- small bodies: a quarter of the slots is kept for bodies declared at most SMALL_BODY_BYTES (a
  chat), which large or undeclared (chunked) bodies cannot take;
- transfer rate: after `body_grace_s`, a body must keep arriving at `body_min_bytes_per_s` on
  average (besides the whole-body `body_timeout_s`), so a stalled slot is given back within
  seconds rather than at the timeout.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections import Counter
from dataclasses import dataclass, field

from aiohttp import web

SMALL_BODY_BYTES = 64 << 10
SMALL_BODY_SHARE = 4  # 1/4 of the upload slots kept for small bodies


def upload_limit(ingress_limit: int) -> int:
    """Bodies read at once: well above the ingress limit, so that stalled uploads leave room for
    every client the engine could serve."""
    return max(8 * ingress_limit, 256)


def client_of(request: web.Request) -> str:
    """The client address a request counts under (upload slots, service prices, the cap on live
    requests): the peer's IP, an IPv6 peer's /64 network."""
    remote = request.remote or "unknown"
    try:
        address = ipaddress.ip_address(remote)
    except ValueError:
        return remote
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


def is_small(request: web.Request) -> bool:
    return request.content_length is not None and request.content_length <= SMALL_BODY_BYTES


@dataclass
class Uploads:
    limit: int  # bodies arriving at once, in all
    per_client: int  # bodies arriving at once from one client
    in_progress: int = 0
    large: int = 0  # of them, bodies not declared small
    by_client: Counter[str] = field(default_factory=Counter)

    def refusal(self, client: str, small: bool) -> str | None:
        """Why a body from `client` cannot start arriving now (a 429's message), or None."""
        if self.in_progress >= self.limit:
            return f"{self.in_progress} request bodies are arriving at once, the server's limit; retry later"
        if self.by_client[client] >= self.per_client:
            return (f"{self.by_client[client]} request bodies from your address are arriving at once, the limit per "
                    f"client (server.uploads_per_client); finish or close them, or retry later")
        if not small and self.large >= self.limit - self.limit // SMALL_BODY_SHARE:
            return (f"{self.large} large request bodies are arriving at once, their share of the server's upload "
                    f"slots (the rest is kept for bodies of at most {SMALL_BODY_BYTES} bytes); retry later")
        return None

    def take(self, client: str, small: bool) -> None:
        self.in_progress += 1
        self.large += not small
        self.by_client[client] += 1

    def give_back(self, client: str, small: bool) -> None:
        self.in_progress -= 1
        self.large -= not small
        self.by_client[client] -= 1
        if not self.by_client[client]:
            del self.by_client[client]


class TooSlow(Exception):
    """The body fell below the minimum transfer rate."""


class TooLarge(Exception):
    """The body grew past the size limit (a chunked body declares no size)."""


async def read_body(request: web.Request, limit: int, min_bytes_per_s: float, grace_s: float) -> bytes:
    """The body, read as it arrives: TooLarge past `limit` bytes, TooSlow once fewer than
    `min_bytes_per_s` × (elapsed − `grace_s`) bytes have come."""
    loop = asyncio.get_running_loop()
    started, received, chunks = loop.time(), 0, []
    while True:
        # By this time the next bytes must have come, for the average rate to hold.
        due = started + grace_s + received / min_bytes_per_s
        try:
            chunk = await asyncio.wait_for(request.content.readany(), timeout=max(due - loop.time(), 0.0))
        except TimeoutError:
            raise TooSlow() from None
        if not chunk:
            return b"".join(chunks)
        received += len(chunk)
        if received > limit:
            raise TooLarge()
        chunks.append(chunk)
