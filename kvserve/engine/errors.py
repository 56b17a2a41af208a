"""The errors a caller of the engine (the HTTP server) handles, re-exported from where they are
raised, so that kvserve.server imports kvserve.engine only (server -> engine)."""

from kvserve.core.scheduler import (
    QueueFullError,
)  # add_request: the waiting queue is full (HTTP 429)

__all__ = ["QueueFullError", "CONSTRAINT_FAILED"]

# How a request's error (RequestOutput.error) begins when its own output constraint failed while
# generating (a grammar past the matcher's limits at a later step): the client's doing, a 400.
CONSTRAINT_FAILED = "structured output: "
