"""specdec: distributed, lossless speculative decoding as gRPC microservices.

The public face is the client SDK:

    import specdec
    with specdec.Client("localhost:50051") as client:
        print(client.generate("Hello", max_new_tokens=32).text)
"""

from specdec.client import (
    AsyncClient,
    Chunk,
    Client,
    GenerateOptions,
    ModelInfo,
    Result,
    ResumeOptions,
    ServerInfo,
    SpecdecClientError,
    Stats,
)

__all__ = [
    "AsyncClient", "Chunk", "Client", "GenerateOptions", "ModelInfo", "Result", "ResumeOptions", "ServerInfo",
    "SpecdecClientError", "Stats",
]
__version__ = "0.1.0"
