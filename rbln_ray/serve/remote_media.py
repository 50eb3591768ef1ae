"""Remote media a replica may fetch: public addresses only, checked after DNS, redirects off.

Why: with ``limits.allow_remote_images`` a replica's vLLM fetches the image URLs clients
name. vLLM checks a URL's host name against ``allowed_media_domains`` (when set) and nothing
else: ``http://127.0.0.1:8265/``, ``http://169.254.169.254/`` (a cloud's metadata service),
``http://2130706433/`` (127.0.0.1 as a decimal number) or a name that resolves to a private
address all reach inside the cluster (server-side request forgery). And a check of the name's
addresses *before* the fetch would not do: DNS may answer differently when the fetch resolves
it again (rebinding).

So a replica fetches through :class:`PublicOnlyConnector`, registered in vLLM's
``MEDIA_CONNECTOR_REGISTRY`` (vLLM's extension point for media fetching, selected by
``VLLM_MEDIA_CONNECTOR``, :func:`replica_env`): its HTTP client resolves each host once,
refuses it unless every address is public (:func:`address_allowed`: not private, loopback,
link-local, multicast, reserved or unspecified; IPv4-mapped IPv6 judged as IPv4), and connects
to exactly those addresses; an IP literal is judged as given. Redirects are never followed,
whatever ``VLLM_MEDIA_URL_ALLOW_REDIRECTS`` says, and proxies from the environment are not
used (a proxy would resolve the name itself).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any

from urllib3.util import parse_url
from vllm.connections import HTTPConnection
from vllm.exceptions import VLLMValidationError
from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector

CONNECTOR = "rbln-ray-public-only"


class RefusedAddress(VLLMValidationError):
    """A media URL whose host is not a public address (the message says which): vLLM's
    client error, so the client gets a 400 with this message."""


def address_allowed(address: str) -> bool:
    """Whether a fetch may connect to ``address``: a public unicast address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified)


def _literal(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return None


class PublicOnlyResolver:
    """aiohttp resolver: the host's addresses, all of them public, or :class:`RefusedAddress`.
    aiohttp connects to the addresses this returns, so what was checked is what is used."""

    def __init__(self, allowed: Any = address_allowed) -> None:
        self.allowed = allowed

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM, family=family
        )
        hosts = []
        for fam, _, proto, _, sockaddr in infos:
            address = sockaddr[0]
            if not self.allowed(address):
                message = f"media host {host!r} resolves to {address}, not a public address"
                raise RefusedAddress(f"{message}: refused")
            hosts.append(
                {"hostname": host, "host": address, "port": sockaddr[1], "family": fam,
                 "proto": proto, "flags": socket.AI_NUMERICHOST}
            )  # fmt: skip
        if not hosts:
            raise RefusedAddress(f"media host {host!r} does not resolve")
        return hosts

    async def close(self) -> None:
        return None


class PublicOnlyConnection(HTTPConnection):
    """vLLM's HTTP helper, fetching only from public addresses and never following a
    redirect (module docstring)."""

    def __init__(self, allowed: Any = address_allowed) -> None:
        super().__init__(reuse_client=True)
        self.allowed = allowed

    async def get_async_client(self) -> Any:
        import aiohttp

        if self._async_client is None:
            connector = aiohttp.TCPConnector(resolver=PublicOnlyResolver(self.allowed))
            self._async_client = aiohttp.ClientSession(connector=connector, trust_env=False)
        return self._async_client

    def _check_url(self, url: str) -> None:
        host = parse_url(url).host or ""
        literal = _literal(host)  # aiohttp connects to an IP literal without resolving it
        if literal is not None and not self.allowed(literal):
            raise RefusedAddress(f"media host {host!r} is not a public address: refused")

    async def get_async_response(self, url: str, *, allow_redirects: bool = True, **kw: Any):
        self._check_url(url)
        return await super().get_async_response(url, allow_redirects=False, **kw)

    def get_response(self, url: str, *, allow_redirects: bool = True, **kw: Any):
        raise RefusedAddress(
            "synchronous media fetches are off in rbln-ray replicas (the asynchronous path "
            "checks each address it connects to)"
        )


@MEDIA_CONNECTOR_REGISTRY.register(CONNECTOR)
class PublicOnlyConnector(MediaConnector):
    """vLLM's media connector over :class:`PublicOnlyConnection`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("connection", PublicOnlyConnection())
        super().__init__(*args, **kwargs)


def replica_env() -> dict[str, str]:
    """What a replica's vLLM needs to fetch media through this module (set before its
    serving objects exist; this module must be imported in the replica's process)."""
    return {"VLLM_MEDIA_CONNECTOR": CONNECTOR, "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"}
