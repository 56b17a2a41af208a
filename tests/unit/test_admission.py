"""The AsyncEngine's admission fast path on a stand-in core (no model): queue places reserved
by requests being prepared count against the queue at once and are given back when the block
ends, so a burst is refused from its first request past the limit."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.errors import QueueFullError


class IdleCore:
    """What AsyncEngine reads of an EngineCore, with nothing to run."""

    def __init__(self, max_waiting: int):
        self.tokenizer = None
        self.model_name = "stand-in"
        self.max_model_len = 64
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_waiting=max_waiting))
        self.grammar = SimpleNamespace(warm_up=lambda: None)

    def stats(self) -> dict:
        return {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}

    def has_unfinished_requests(self) -> bool:
        return False


@pytest.fixture
def engine():
    import asyncio
    e = AsyncEngine(IdleCore(max_waiting=16))
    yield e
    asyncio.run(e.shutdown(0.1))


def test_reservations_count_at_once_and_come_back(engine):
    with engine.reserve(10) as held:
        assert held.left == 10
        with pytest.raises(QueueFullError):
            engine.check_queue(7)
        engine.check_queue(6)
        with engine.reserve(6):
            with pytest.raises(QueueFullError):
                engine.check_queue(1)
    engine.check_queue(16)                  # every place given back


def test_a_request_that_can_never_fit_is_a_value_error(engine):
    with pytest.raises(ValueError, match="never fit"):
        engine.check_queue(17)
    with pytest.raises(ValueError):
        with engine.reserve(17):
            pass
    engine.check_queue(16)


def test_an_error_inside_the_block_gives_the_places_back(engine):
    with pytest.raises(RuntimeError):
        with engine.reserve(16):
            raise RuntimeError("tokenizing failed")
    engine.check_queue(16)
