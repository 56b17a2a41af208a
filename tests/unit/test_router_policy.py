"""The router's choice of replica (kvserve/router/policy.py): prefix affinity within a load slack,
least loaded otherwise, unhealthy replicas never, and the routing key of each endpoint."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.router.policy import BLOCK_CHARS, Router, block_hashes, routing_key

A, B, C = "http://a:1", "http://b:1", "http://c:1"
SYSTEM = "You are a careful assistant who answers questions about the attached manual. " * 4


def make(policy="prefix", urls=(A, B, C), **kw) -> Router:
    r = Router(list(urls), policy, **kw)
    for rep in r.replicas:
        rep.healthy = True
    return r


def test_block_hashes_are_chained_and_cut_at_full_blocks():
    text = "x" * (3 * BLOCK_CHARS + 5)
    h = block_hashes(text)
    assert len(h) == 3 and len(set(h)) == 3  # same blocks, different chains
    assert block_hashes(text[: 2 * BLOCK_CHARS]) == h[:2]
    assert block_hashes("y" + text)[0] != h[0]
    assert block_hashes("short") == []
    assert len(block_hashes("z" * 10 * BLOCK_CHARS, max_blocks=4)) == 4
    assert len(block_hashes("\ud800" * BLOCK_CHARS)) == 1  # a lone surrogate hashes, never raises


def test_a_shared_prefix_goes_back_to_the_replica_that_holds_it():
    r = make()
    first, matched = r.choose(SYSTEM + "Question 1: how do I reset it?")
    assert matched == 0
    for i in range(2, 8):
        again, matched = r.choose(SYSTEM + f"Question {i}: and then?")
        assert again is first and matched == len(SYSTEM) // BLOCK_CHARS
    assert first.routed == 7 and first.prefix_routed == 6


def test_new_prefixes_spread_over_the_least_loaded():
    r = make()
    chosen = []
    for i in range(3):
        rep, _ = r.choose(f"conversation {i} " * 40)
        rep.in_flight += 1
        chosen.append(rep)
    assert len({id(c) for c in chosen}) == 3


def test_affinity_yields_to_load_beyond_the_slack():
    r = make(balance_slack=2, balance_ratio=0.0)
    home, _ = r.choose(SYSTEM + "q0")
    home.in_flight = 3  # the others have 0: more than the slack of 2
    other, matched = r.choose(SYSTEM + "q1")
    assert other is not home and matched == 0
    other.healthy = False  # (it holds the prefix now too)
    home.in_flight = 2  # within the slack: the prefix wins
    assert r.choose(SYSTEM + "q2") == (home, len(SYSTEM) // BLOCK_CHARS)


def test_unhealthy_replicas_get_nothing_and_none_left_means_none():
    r = make()
    home, _ = r.choose(SYSTEM + "q0")
    home.healthy = False
    assert r.choose(SYSTEM + "q1")[0] is not home
    for rep in r.replicas:
        rep.healthy = False
    assert r.choose(SYSTEM) == (None, 0)
    r.replicas[1].healthy = True
    assert r.choose(SYSTEM, exclude=(r.replicas[1],)) == (None, 0)
    assert r.choose(SYSTEM)[0] is r.replicas[1]


def test_the_slack_grows_with_the_load():
    r = make(balance_slack=1, balance_ratio=0.25)
    home, _ = r.choose(SYSTEM + "q0")
    for rep in r.replicas:
        rep.in_flight = 20
    home.in_flight = 25  # 20 + max(1, 5): still home
    assert r.choose(SYSTEM + "q1")[0] is home
    home.in_flight = 26
    assert r.choose(SYSTEM + "q2")[0] is not home


def test_a_prefix_everyone_shares_does_not_pull_every_request_to_one_replica():
    r = make(urls=(A, B))
    homes = []
    for i in range(8):  # four conversations at a time
        rep, _ = r.choose(SYSTEM + f"conversation {i}")
        rep.in_flight += 1
        homes.append(rep.url)
        if i % 4 == 3:
            for x in r.replicas:
                x.in_flight = 0
    assert homes.count(A) == homes.count(B) == 4


def test_least_loaded_and_random_ignore_prefixes():
    r = make("least_loaded")
    seen = set()
    for _ in range(6):
        rep, matched = r.choose(SYSTEM)
        assert matched == 0
        seen.add(rep.url)
    assert seen == {A, B, C}  # equal load: round robin
    rnd = make("random")
    assert {rnd.choose(SYSTEM)[0].url for _ in range(60)} == {A, B, C}


def test_each_replica_remembers_a_bounded_number_of_blocks():
    r = make(urls=(A,), max_blocks=10)
    for i in range(20):
        r.choose(f"{i:04d}" * 100)
    assert len(r.replicas[0].blocks) == 10


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="at least one replica"):
        Router([], "prefix")
    with pytest.raises(ValueError, match="given twice"):
        Router([A, A], "prefix")
    with pytest.raises(ValueError, match="not one of"):
        Router([A], "fastest")


def test_routing_keys():
    chat = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ]
    }
    assert routing_key("/v1/chat/completions", chat) == "<system>S<user>hi"
    assert routing_key("/v1/completions", {"prompt": "abc"}) == "abc"
    assert routing_key("/v1/completions", {"prompt": ["abc", "def"]}) == "abc"
    assert routing_key("/v1/completions", {"prompt": [1, 2, 3]}) == "1 2 3"
    assert routing_key("/v1/completions", {}) == ""
    assert routing_key("/v1/chat/completions", {"messages": "nope"}) == ""


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=20,
    )
)
def test_any_json_body_gives_a_key_and_a_choice(value):
    r = make()
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = {"prompt": value, "messages": value}
        key = routing_key(path, body)
        assert isinstance(key, str)
        assert r.choose(key)[0] is not None
