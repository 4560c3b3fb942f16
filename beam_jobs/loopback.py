"""Keep the local Beam runner's gRPC servers on the loopback interface.

With `--direct_running_mode=multi_processing` the FnApiRunner starts control, data, state and
logging gRPC servers for its worker processes with `add_insecure_port('[::]:0')`: ports on
every interface, without authentication, for as long as the job runs. Its workers
only ever connect to `localhost`, so while the local runner runs, servers created through
`grpc.server` (public grpcio API) bind `localhost` instead of the wildcard address.
tests/test_sockets.py reads the listening sockets of a running job: if a Beam upgrade binds
differently, it fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc

_WILDCARDS = ("[::]", "0.0.0.0", "")


def loopback_address(address: str) -> str:
    """`[::]:0` -> `localhost:0`; any other address as given."""
    host, _, port = address.rpartition(":")
    return f"localhost:{port}" if host in _WILDCARDS else address


@contextmanager
def loopback_grpc_servers() -> Iterator[None]:
    """Within the block, gRPC servers asked to listen on all interfaces listen on localhost."""
    original = grpc.server

    def server(*args: Any, **kwargs: Any) -> grpc.Server:
        created = original(*args, **kwargs)
        add = created.add_insecure_port
        created.add_insecure_port = lambda address: add(loopback_address(address))
        return created

    grpc.server = server
    try:
        yield
    finally:
        grpc.server = original
