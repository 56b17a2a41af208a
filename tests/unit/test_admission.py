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
    engine.check_queue(16)  # every place given back


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


def test_requests_on_their_way_count_as_ahead(engine):
    """The HTTP protocol's early check counts requests it let through that have not reserved yet
    (`ahead`): the 17th of a burst gets its 429 before the first 16 reach the engine."""
    engine.check_queue(1, ahead=15)
    with pytest.raises(QueueFullError):
        engine.check_queue(1, ahead=16)
    with pytest.raises(QueueFullError):
        engine.check_queue(1, ahead=400)  # many pending: a 429, never "can never fit"


def test_a_pending_admission_is_released_once():
    from kvserve.server.connections import Admission, PendingAdmissions

    pending = PendingAdmissions()
    a, b = Admission(pending), Admission(pending)
    assert pending.count == 2
    a.release()
    a.release()  # at its reservation and again at its response's end
    assert pending.count == 1
    b.release()
    assert pending.count == 0
