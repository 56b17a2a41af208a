"""The errors a caller of the engine (the HTTP server) handles, re-exported from where they are
raised, so that kvserve.server imports kvserve.engine only (DESIGN.md: server -> engine)."""
from kvserve.core.scheduler import QueueFullError   # add_request: the waiting queue is full (HTTP 429)

__all__ = ["QueueFullError"]
