"""Beam search through the OpenAI API (vLLM's use_beam_search extension), official client."""

import openai
import pytest


def test_completion_beam_search_returns_the_n_best_beams(client, model_name):
    kw = dict(
        model=model_name,
        prompt="The three primary colors are",
        max_tokens=8,
        n=2,
        extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 1.0},
    )
    r = client.completions.create(**kw)
    assert len(r.choices) == 2 and {c.index for c in r.choices} == {0, 1}
    assert r.choices[0].text != r.choices[1].text
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert r.usage.completion_tokens >= 2
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # deterministic


def test_chat_beam_search(client, model_name):
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=6,
        n=2,
        extra_body={"use_beam_search": True},
    )
    assert len(r.choices) == 2 and all(c.message.content for c in r.choices)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
        ({"use_beam_search": True, "best_of": 1, "n": 2}, "best_of"),
        ({"best_of": 3}, "best_of"),
        ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
    ],
)
def test_bad_beam_fields_get_400_naming_them(client, model_name, extra, param):
    n = extra.pop("n", 1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="x", max_tokens=4, n=n, extra_body=extra)
    assert e.value.body["param"] == param
