"""loader.load_weights: weights load on threads, each layer's tensors in file order."""
import random
import threading
import time

import pytest

from kvserve.model import loader


class RecordingModel:
    """load_weight records (name, thread) and sleeps a little, so that loads overlap."""

    def __init__(self, fail_on=None):
        self.order, self.threads, self.fail_on = [], set(), fail_on
        self.lock = threading.Lock()
        self.running = self.max_running = 0

    def load_weight(self, name, w):
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        time.sleep(random.uniform(0, 0.004))
        with self.lock:
            self.running -= 1
            self.order.append(name)
            self.threads.add(threading.get_ident())
        if name == self.fail_on:
            raise ValueError(f"bad tensor {name}")


def names(layers=6, per_layer=5):
    out = ["model.embed_tokens.weight"]
    for i in range(layers):
        out += [f"model.layers.{i}.part{j}.weight" for j in range(per_layer)]
    return out + ["model.norm.weight"]


def test_each_layer_loads_in_file_order_while_layers_overlap():
    random.seed(0)
    model, want = RecordingModel(), names()
    assert loader.load_weights(model, ((n, None) for n in want)) == set(want)
    assert sorted(model.order) == sorted(want)
    for i in range(6):
        prefix = f"model.layers.{i}."
        assert [n for n in model.order if n.startswith(prefix)] == [n for n in want if n.startswith(prefix)]
    assert model.max_running == loader.LOAD_THREADS > 1


def test_reading_stays_a_bounded_distance_ahead_of_loading():
    model, want, ahead = RecordingModel(), names(layers=20), []

    def weights():
        for n in want:
            ahead.append(len(ahead) - len(model.order))     # read but not yet loaded
            yield n, None
    loader.load_weights(model, weights())
    assert max(ahead) <= loader.READ_AHEAD + 1


def test_a_failed_load_raises_its_error_and_stops():
    want = names(layers=20)
    model = RecordingModel(fail_on="model.layers.2.part1.weight")
    with pytest.raises(ValueError, match="bad tensor model.layers.2.part1.weight"):
        loader.load_weights(model, ((n, None) for n in want))
    assert len(model.order) < len(want)       # the rest was not loaded
    assert "model.layers.2.part2.weight" not in model.order   # nor the failed layer's later tensors
