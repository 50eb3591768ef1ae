"""Names of the Serve app and its deployments, shared by the builder and the client handles.

Why its own module: a client that only needs a deployment's name must not import the builder
(FastAPI, vLLM's OpenAI layer) to get it.
"""

APP_NAME = "rbln-ray"


def server_deployment_name(model_name: str) -> str:
    """The ``LLMServer`` deployment serving ``model_name``."""
    return f"LLMServer:{model_name}"
