"""Remote media in a replica (rbln_ray.serve.remote_media), through vLLM's own media connector
code: a URL whose host is, or resolves to, anything but a public address is refused before
any connection, and a redirect is never followed, whatever vLLM's environment says."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import BytesIO

import pytest


@pytest.fixture(scope="module")
def rm():
    """rbln_ray.serve.remote_media, imported when the tests run (importing vLLM at collection
    would fix its platform before the unit tier's conftest chooses the emulated RBLN one)."""
    from rbln_ray.serve import remote_media

    return remote_media


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("8.8.8.8", True), ("2001:4860:4860::8888", True), ("127.0.0.1", False),
        ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
        ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False),
        ("224.0.0.1", False), ("255.255.255.255", False), ("::1", False), ("fe80::1", False),
        ("fc00::1", False), ("::ffff:127.0.0.1", False), ("::ffff:8.8.8.8", True),
        ("ff02::1", False),
    ],
)  # fmt: skip
def test_only_public_unicast_addresses_are_allowed(rm, address: str, allowed: bool) -> None:
    assert rm.address_allowed(address) is allowed


class Local:
    """An HTTP server on 127.0.0.1 that counts requests: /img.png serves a PNG, /jump
    redirects to it."""

    def __init__(self) -> None:
        from PIL import Image

        buf = BytesIO()
        Image.new("RGB", (4, 4), "red").save(buf, format="PNG")
        png, hits = buf.getvalue(), []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                hits.append(self.path)
                if self.path == "/jump":
                    self.send_response(302)
                    self.send_header("Location", "/img.png")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)

            def log_message(self, *args: object) -> None:
                pass

        self.hits = hits
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def local():
    server = Local()
    yield server
    server.close()


def fetch(rm, url: str, connection=None):
    """vLLM's own path for an image URL in a chat message: the registered connector
    (VLLM_MEDIA_CONNECTOR in a replica), ``load_from_url_async`` with vLLM's ImageMediaIO."""
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY
    from vllm.multimodal.media.image import ImageMediaIO

    kwargs = {"connection": connection} if connection else {}
    connector = MEDIA_CONNECTOR_REGISTRY.load(rm.CONNECTOR, **kwargs)

    async def go():
        try:
            return await connector.load_from_url_async(url, ImageMediaIO())
        finally:
            client = connector.connection._async_client
            if client is not None:
                await client.close()

    return asyncio.run(go())


def test_private_hosts_are_refused_before_any_connection(rm, local) -> None:
    """127.0.0.1 as given, as a name that resolves to it, and as an IPv6 loopback: refused,
    naming the address; as a decimal number (aiohttp itself refuses that form): refused
    too. The server never sees a request."""
    for host in ("127.0.0.1", "localhost", "[::1]"):
        with pytest.raises(rm.RefusedAddress, match="not a public address"):
            fetch(rm, f"http://{host}:{local.port}/img.png")
    with pytest.raises(Exception, match="Invalid URL"):  # noqa: PT011 - vLLM's 422
        fetch(rm, f"http://2130706433:{local.port}/img.png")
    assert local.hits == []


def test_a_redirect_is_never_followed(rm, local, monkeypatch) -> None:
    """With loopback allowed (the only way to have a server here), a fetch reaches it, and a
    redirect stays unfollowed even when vLLM's environment asks for redirects."""
    monkeypatch.setenv("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "1")
    loopback = rm.PublicOnlyConnection(allowed=lambda address: address == "127.0.0.1")
    image = fetch(rm, f"http://127.0.0.1:{local.port}/img.png", loopback)
    assert image.size == (4, 4) and local.hits == ["/img.png"]
    with pytest.raises(Exception):  # noqa: B017, PT011 - the 302's empty body is no image
        fetch(rm, f"http://127.0.0.1:{local.port}/jump", rm.PublicOnlyConnection(
            allowed=lambda address: address == "127.0.0.1"))  # fmt: skip
    assert local.hits == ["/img.png", "/jump"]  # the Location was never fetched


def test_a_replica_selects_the_connector_and_turns_redirects_off(rm) -> None:
    assert rm.replica_env() == {"VLLM_MEDIA_CONNECTOR": rm.CONNECTOR,
                                "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"}  # fmt: skip
    with pytest.raises(rm.RefusedAddress, match="synchronous"):
        rm.PublicOnlyConnection().get_bytes("http://8.8.8.8/x.png")
