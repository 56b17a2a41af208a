"""Constrained decoding on the real model: every constraint kind gives output that parses and
validates, with sampling (temperature, top-p, seeds), n > 1, logprobs, stop strings, chunked
prefill and preemption; a grammar that does not compile is a ParamError, never an unconstrained
answer."""

from __future__ import annotations

import json
import re

import pytest

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import ParamError, StructuredOutputs

jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "colors"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person named Ann, as JSON."}]


@pytest.fixture(scope="module")
def llm(default_gguf):
    return LLM(default_gguf, num_threads=1, kv_cache_memory="64MiB", max_model_len=1024)


def texts(llm, messages, **kw) -> list:
    params = SamplingParams(**{"max_tokens": 96, **kw})
    out = llm.chat([messages], params, use_tqdm=False)[0]
    return out.outputs


def test_json_schema_outputs_validate(llm):
    outs = texts(
        llm,
        ASK,
        n=3,
        temperature=0.9,
        top_p=0.95,
        seed=3,
        structured_outputs=StructuredOutputs(json=PERSON),
    )
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
    assert len({o.text for o in outs}) > 1  # sampling still samples


def test_json_object_regex_choice_and_grammar(llm):
    so = StructuredOutputs(json_object=True)
    for o in texts(llm, ASK, n=2, temperature=0.7, seed=1, max_tokens=200, structured_outputs=so):
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    for o in texts(
        llm,
        [{"role": "user", "content": "Give me a phone number."}],
        n=2,
        temperature=1.0,
        seed=5,
        structured_outputs=StructuredOutputs(regex=phone),
    ):
        assert re.fullmatch(phone, o.text) and o.finish_reason == "stop"
    choices = ["positive", "negative", "neutral"]
    (o,) = texts(
        llm,
        [{"role": "user", "content": "Sentiment of 'I love this!'?"}],
        temperature=0,
        structured_outputs=StructuredOutputs(choice=choices),
    )
    assert o.text in choices
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    (o,) = texts(
        llm,
        [{"role": "user", "content": "Is the sky blue?"}],
        temperature=0,
        structured_outputs=StructuredOutputs(grammar=lark),
    )
    assert re.fullmatch(r"The answer is (yes|no)\.", o.text)


def test_constraints_keep_logprobs_stop_strings_and_ignore_eos_working(llm):
    (o,) = texts(
        llm,
        ASK,
        temperature=0,
        logprobs=2,
        ignore_eos=True,
        structured_outputs=StructuredOutputs(json=PERSON),
    )
    jsonschema.validate(
        json.loads(o.text), PERSON
    )  # the complete grammar stops it even with ignore_eos
    assert len(o.logprobs) == len(o.token_ids) and all(lp.logprob <= 0 for lp in o.logprobs)
    (o,) = texts(
        llm, ASK, temperature=0, stop=['"age"'], structured_outputs=StructuredOutputs(json=PERSON)
    )
    assert o.finish_reason == "stop" and '"age"' not in o.text and o.text.startswith("{")


def test_under_preemption_and_chunked_prefill(default_gguf):
    """A pool of 8 blocks and a budget of 32 tokens: requests are preempted and recomputed, their
    prompts chunked; the matchers stay in step with the tokens and every output validates."""
    llm = LLM(
        default_gguf,
        num_threads=1,
        kv_cache_memory="6MiB",
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    params = SamplingParams(
        max_tokens=64, temperature=0.8, seed=11, structured_outputs=StructuredOutputs(json=PERSON)
    )
    outs = llm.chat([ASK] * 6, params, use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    done = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert done
    for o in done:
        jsonschema.validate(json.loads(o.text), PERSON)


@pytest.mark.parametrize(
    "so",
    [
        StructuredOutputs(grammar="start: ("),
        StructuredOutputs(regex="(unclosed"),
        StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
    ],
)
def test_constraints_that_do_not_compile_are_param_errors(llm, so):
    with pytest.raises(ParamError) as e:
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=so))
    assert e.value.param == "structured_outputs" and str(e.value)
    assert not llm.engine.has_unfinished_requests()
