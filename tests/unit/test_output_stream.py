"""A request's output stream on the event loop (kvserve/engine/async_engine.py OutputStream) and
RequestOutput.merge: a reader that fell behind takes the outputs of several steps as one, with
every token, every logprob and the text of all of them, in order; an error comes after the
outputs that came before it, and ends the stream."""

import asyncio

from kvserve.engine.async_engine import OutputStream
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput


def _lp(t):
    return Logprob(t, -0.5 * t, 1, f"<{t}>")


def _step(index, tokens, text_before, new_text, finished=False, before_tokens=()):
    """A sample's snapshot as the server gets it: an unfinished one carries the step's lists,
    the final one whole lists."""
    whole = list(before_tokens) + list(tokens)
    lists = whole if finished else list(tokens)
    return CompletionOutput(
        index=index,
        text=text_before + new_text,
        token_ids=lists,
        delta_text=new_text,
        delta_token_ids=list(tokens),
        logprobs=[_lp(t) for t in lists],
        delta_logprobs=[_lp(t) for t in tokens],
        cumulative_logprob=-0.5 * sum(whole),
        finish_reason="length" if finished else None,
    )


def _out(outputs, finished=False):
    return RequestOutput("r", [1, 2], outputs, finished)


def test_merging_unfinished_outputs_joins_their_deltas():
    a = _out([_step(0, [5], "", "a"), _step(1, [7], "", "x")])
    b = _out([_step(0, [6, 8], "a", "bc")])  # sample 1 did not change in b's step
    m = a.merge(b)
    s0, s1 = m.outputs
    assert (s0.index, s0.delta_text, s0.text, s0.delta_token_ids) == (0, "abc", "abc", [5, 6, 8])
    assert s0.token_ids == [5, 6, 8] and [lp.token_id for lp in s0.logprobs] == [5, 6, 8]
    assert [lp.token_id for lp in s0.delta_logprobs] == [5, 6, 8]
    assert s0.cumulative_logprob == b.outputs[0].cumulative_logprob and not m.finished
    assert s1 is a.outputs[1]
    assert a.outputs[0].delta_token_ids == [5] and b.outputs[0].token_ids == [6, 8]  # untouched


def test_merging_into_the_final_output_keeps_its_whole_lists():
    a = _out([_step(0, [5, 6], "ab", "cd")])
    b = _out([_step(0, [9], "abcd", "e", finished=True, before_tokens=[1, 2, 5, 6])], True)
    m = a.merge(b)
    (s,) = m.outputs
    assert m.finished and s.finish_reason == "length"
    assert s.token_ids == [1, 2, 5, 6, 9] and s.delta_token_ids == [5, 6, 9]
    assert s.delta_text == "cde" and s.text == "abcde"
    assert [lp.token_id for lp in s.logprobs] == [1, 2, 5, 6, 9]


def test_a_reader_that_fell_behind_gets_one_merged_output_then_the_error():
    async def scenario():
        stream = OutputStream()
        stream.put(_out([_step(0, [1], "", "a")]))
        stream.put(_out([_step(0, [2], "a", "b")]))
        stream.put(_out([_step(0, [3], "ab", "c")]))
        stream.put(RuntimeError("boom"))
        stream.put(_out([_step(0, [4], "abc", "d")]))  # after the error: the request is over
        return await stream.get(), await stream.get()

    first, second = asyncio.run(scenario())
    assert first.outputs[0].delta_text == "abc" and first.outputs[0].delta_token_ids == [1, 2, 3]
    assert isinstance(second, RuntimeError)


def test_a_reader_that_keeps_up_gets_each_output_as_it_comes():
    async def scenario():
        stream = OutputStream()
        got = []

        async def reader():
            for _ in range(3):
                got.append(await stream.get())

        task = asyncio.create_task(reader())
        for i, ch in enumerate("xyz"):
            await asyncio.sleep(0)
            stream.put(_out([_step(0, [i], "", ch)]))
            await asyncio.sleep(0.01)
        await task
        return got

    got = asyncio.run(scenario())
    assert [o.outputs[0].delta_text for o in got] == ["x", "y", "z"]
