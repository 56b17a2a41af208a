"""The client ring's fixtures: a `kvserve serve` subprocess as tests/server starts it (its
conftest's code, imported: pytest only shares a conftest's fixtures with the folders below it),
on the default model with an API key and /tokenizer_info on. The ring's server stops after the
ring's last test, so the rest of a whole-suite run does not carry it.

KVSERVE_CLIENTS_SERVER=http://127.0.0.1:PORT runs the ring against a server already started with
tests/server/conftest.SERVER_ARGS instead (quicker when iterating on one client)."""

import os

import pytest

from tests.server.conftest import (  # noqa: F401
    API_KEY,
    SERVER_ARGS,
    ServerProcess,
    aclient_factory,
    client,
    model_name,
)

_started: list[ServerProcess] = []


@pytest.fixture(scope="session")
def server() -> str:
    """Base URL of the ring's server (http://127.0.0.1:PORT)."""
    url = os.environ.get("KVSERVE_CLIENTS_SERVER")
    if url:
        yield url.rstrip("/")
        return
    from tests.conftest import default_model_or_skip

    default_model_or_skip()
    srv = ServerProcess(SERVER_ARGS)
    _started.append(srv)
    srv.wait_ready()
    yield srv.base_url
    srv.stop()
    os.unlink(srv.log.name)


def pytest_runtest_teardown(item, nextitem):
    """Stop the ring's server once the next test is not one of the ring's."""
    here = os.path.dirname(__file__)
    if _started and (nextitem is None or os.path.dirname(str(nextitem.path)) != here):
        _started[0].stop()
