"""Python client handles for a running rbln-ray Serve app (no HTTP).

From any driver connected to the cluster::

    from rbln_ray.client import RBLNClient
    client = RBLNClient("demo")                     # ray.init(address="auto") if needed
    print(client.complete("def main(", max_tokens=32).text)
    for delta in client.stream("import os\\n", max_tokens=32):
        print(delta, end="", flush=True)
    client.chat([{"role": "user", "content": "hi"}]).text

Over HTTP, use the ``openai`` package against ``http://HOST:PORT/v1`` instead.
"""

from rbln_ray.client.handle import Completion, RBLNClient, RBLNRequestError

__all__ = ["Completion", "RBLNClient", "RBLNRequestError"]
