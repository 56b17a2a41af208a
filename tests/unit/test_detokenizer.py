"""IncrementalDetokenizer on a tiny byte-level BPE trained here (Korean, emoji, English)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.sampling_params import SamplingParams

CORPUS = [
    "Hello there, how are you today? The end is near, the enormous cat said.",
    "안녕하세요, 세계! 오늘 날씨가 정말 좋네요. 감사합니다.",
    "Emoji time 🙂🚀👍🏽 and 🎉 party with friends 🍕🍺",
    "Mixed 한국어 text with emoji 😀 and words, then STOP NOW please.",
] * 3
EOS = "<|eos|>"


class TinyTokenizer:
    """The few methods the detokenizer relies on, over a `tokenizers.Tokenizer`."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.all_special_ids = [tok.token_to_id(EOS)]
        self.decoded_lengths: list[int] = []  # length of every id list passed to decode

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens=True) -> str:
        self.decoded_lengths.append(len(ids))
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        return [self.tok.id_to_token(i) for i in ids]


@pytest.fixture(scope="module")
def tokenizer() -> TinyTokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return TinyTokenizer(tok)


def stream(tokenizer, text: str, params: SamplingParams, chunk: int = 1, prompt: str = "Say it:"):
    """Feed `text`'s tokens `chunk` at a time; return (deltas, stop flags, detokenizer)."""
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), params)
    deltas, stops = [], []
    for i in range(0, len(ids), chunk):
        delta, stop = detok.add_tokens(ids[i : i + chunk])
        deltas.append(delta)
        stops.append(stop)
    return deltas, stops, detok


def test_tokenizer_splits_characters_across_tokens(tokenizer):
    """Guard: the test text really has tokens that end inside a UTF-8 character."""
    ids = tokenizer.encode("안녕하세요, 세계! 🙂🚀👍🏽 오늘")
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("chunk", [1, 3])
def test_korean_and_emoji_stream_exactly(tokenizer, chunk):
    text = "안녕하세요, 세계! 🙂🚀👍🏽 오늘 날씨가 😀 좋네요 🎉🍕 The end."
    deltas, stops, detok = stream(tokenizer, text, SamplingParams(), chunk=chunk)
    assert not any(stops)
    assert all("\ufffd" not in d for d in deltas)
    assert detok.flush() == ""
    assert "".join(deltas) == tokenizer.decode(tokenizer.encode(text)) == text
    assert detok.text == text


def test_decode_window_stays_small(tokenizer):
    text = "안녕하세요 🙂 hello there, " * 30
    tokenizer.decoded_lengths.clear()
    deltas, _, detok = stream(tokenizer, text, SamplingParams())
    assert "".join(deltas) == text
    assert len(tokenizer.encode(text)) > 200
    assert max(tokenizer.decoded_lengths) <= 12  # never the whole output


def test_stop_string_spanning_tokens_is_cut_and_never_leaked(tokenizer):
    text = "안녕하세요, 세계! then STOP NOW please and more"
    stop = "STOP NOW"
    assert len(tokenizer.encode(stop)) >= 3
    expected = text[: text.index(stop)]
    deltas, stops, detok = stream(tokenizer, text, SamplingParams(stop=[stop]))
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert expected.startswith(emitted)  # no delta ever holds a piece of the stop string
    assert emitted == expected == detok.text
    assert stops[-1] and stops.index(True) < len(stops) - 1  # matched before the end, then stays
    assert detok.add_tokens(tokenizer.encode(" x")) == ("", True)
    assert detok.flush() == ""


def test_korean_stop_string_with_include_stop_str(tokenizer):
    text = "오늘 날씨가 정말 좋네요. 감사합니다."
    deltas, stops, _ = stream(
        tokenizer, text, SamplingParams(stop=["좋네요"], include_stop_str_in_output=True)
    )
    assert "".join(deltas) == "오늘 날씨가 정말 좋네요"
    assert any(stops)


@pytest.mark.parametrize("stop", [["later", "first"], ["first", "later"]])
def test_earliest_stop_string_wins(tokenizer, stop):
    text = "Hello first there, then later the end"
    deltas, _, detok = stream(
        tokenizer, text, SamplingParams(stop=stop), chunk=len(tokenizer.encode(text))
    )
    assert "".join(deltas) == "Hello "
    assert detok.stop_reason == "first"


def test_held_back_prefix_released_when_it_diverges(tokenizer):
    params = SamplingParams(stop=["the end!"])
    deltas, stops, detok = stream(tokenizer, "the enormous cat", params)
    assert not any(stops)
    joined = "".join(deltas)
    assert "the enormous cat".startswith(joined) and "enormous" in joined
    assert joined + detok.flush() == "the enormous cat"


def test_flush_releases_held_text_when_no_stop_came(tokenizer):
    text = "Hello there, the en"
    deltas, stops, detok = stream(tokenizer, text, SamplingParams(stop=["the end!"]))
    assert not any(stops)
    assert "".join(deltas) == "Hello there, "
    assert detok.flush() == "the en"
    assert detok.text == text


def test_flush_never_emits_a_partial_character(tokenizer):
    ids = tokenizer.encode("좋네요 🙂")
    partial = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    delta, _ = detok.add_tokens(ids[:partial])
    assert "\ufffd" not in delta + detok.flush()


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    ids = tokenizer.encode("Hello there") + tokenizer.all_special_ids
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
    text = "".join(detok.add_tokens([i])[0] for i in ids) + detok.flush()
    assert text == ("Hello there" if skip else "Hello there" + EOS)


@settings(max_examples=300, deadline=None)
@given(
    buf=st.text(alphabet="abST🙂 ", max_size=12),
    stop=st.lists(st.text(alphabet="abST🙂 ", min_size=1, max_size=5), min_size=1, max_size=3),
)
def test_held_back_tail_is_the_longest_stop_prefix(tokenizer, buf, stop):
    """The text held back is the longest suffix of the buffer, shorter than the longest stop
    string, that a stop string begins with (a whole match was cut before this is asked)."""
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stop))
    window = min(max(map(len, stop)) - 1, len(buf))
    longest = max(
        (k for k in range(1, window + 1) if any(s.startswith(buf[-k:]) for s in stop)), default=0
    )
    assert det._stop_prefix_len(buf) == longest


# ---- one decode per token: the same deltas as decoding both windows every step ----


class ReferenceDetokenizer:
    """The two-decode scheme, written out: each token decodes ids[prefix:read] and ids[prefix:]
    and emits the difference unless the text ends mid-character (no stop strings)."""

    def __init__(self, tokenizer, prompt: list[int], skip: bool):
        self.tok, self.skip = tokenizer, skip
        self.ids = list(prompt[-5:])
        self.prefix, self.read = 0, len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self.tok.tok.decode(self.ids[self.prefix : self.read], self.skip)
        new_text = self.tok.tok.decode(self.ids[self.prefix :], self.skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return new_text[len(prefix_text) :]


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    skip=st.booleans(),
    n=st.integers(min_value=0, max_value=40),
)
def test_random_token_streams_match_two_decode_reference(tokenizer, data, skip, n):
    """Any token ids (bytes that break characters, special tokens) give the same delta at every
    step as the two-decode scheme, and a stream of valid text gives its whole decode."""
    vocab = tokenizer.tok.get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), max_size=8))
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(skip_special_tokens=skip))
    ref = ReferenceDetokenizer(tokenizer, prompt, skip)
    for i in ids:
        delta, stopped = detok.add_tokens([i])
        assert delta == ref.add(i) and not stopped


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab 한국어🙂🚀👍🏽é,.\n", max_size=40))
def test_random_text_streams_to_its_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), SamplingParams())
    joined = "".join(detok.add_tokens([i])[0] for i in ids) + detok.flush()
    assert joined == tokenizer.decode(ids) == detok.text


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab 한국🙂👍🏽ST", min_size=1, max_size=30),
    start=st.integers(0, 29),
    length=st.integers(1, 6),
    include=st.booleans(),
)
def test_stop_strings_across_token_boundaries(tokenizer, text, start, length, include):
    """A stop string taken from the text, whatever tokens it spans: the output is the text up to
    its first occurrence (and the stop string with include_stop_str_in_output), and no delta
    ever holds text past that point."""
    start = min(start, len(text) - 1)
    stop = text[start : start + length]
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    deltas, stops, detok = stream(tokenizer, text, params)
    cut = text.index(stop) + (len(stop) if include else 0)
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert text[:cut].startswith(emitted)
    assert stops[-1] and emitted == text[:cut] == detok.text
    assert detok.stop_reason == stop


def test_one_decode_per_token_once_the_window_texts_are_cached(tokenizer):
    text = "hello there, the end is near " * 8
    ids = tokenizer.encode(text)
    stream(tokenizer, text, SamplingParams())  # fills the shared cache of one-token windows
    tokenizer.decoded_lengths.clear()
    deltas, _, _ = stream(tokenizer, text, SamplingParams())
    assert "".join(deltas) == text
    # one decode per token, and one of the prompt's context window (not cached: it is 5 tokens)
    assert len(tokenizer.decoded_lengths) == len(ids) + 1


# ---- deferred text: the server's OutputProcessor detokenizes off the engine thread ----


def run_processor(
    tokenizer, params, ids, defer: bool, finish_at: int | None = None, delta=False, raw=None
):
    """Feed `ids` to an OutputProcessor one step (token) at a time; the snapshots it emits, text
    filled by fill_deferred_text where deferred. `finish_at`: the sequence ends (length) there.
    `delta`: delta snapshots; `raw`: a list that gets the snapshots themselves. With
    params.logprobs, token t comes with logprob -t / 1000."""
    from types import SimpleNamespace

    from kvserve.engine.output_processor import OutputProcessor, fill_deferred_text
    from kvserve.runner.sampler import TokenLogprobs
    from kvserve.runner.step_output import SampledToken

    proc = OutputProcessor(tokenizer)
    proc.defer_text = defer
    proc.delta_snapshots = delta
    seq = SimpleNamespace(
        seq_id="r#0",
        sampling_params=params,
        num_cached_tokens=0,
        finish_reason="length",
        output_token_ids=[],
    )
    state = proc.add("r", tokenizer.encode("Say:"), params, 0.0, [seq])
    sample = state.samples[0]
    snaps = []
    for k, tok in enumerate(ids):
        seq.output_token_ids.append(tok)
        lp = None
        if params.logprobs is not None:
            lp = TokenLogprobs(tok, -tok / 1000, 1, [(tok, -tok / 1000)])
        stopped = proc.append_token(state, sample, SampledToken(tok, lp), 0.0)
        if not stopped and k + 1 == finish_at:
            proc.finish_sample(sample, seq)
        out = proc.emit(state)
        assert not fill_deferred_text(proc.take_deferred())
        snaps.extend(out.outputs)
        if raw is not None:
            raw.extend(out.outputs)
        if out.finished:
            break
    return [(s.text, s.delta_text, s.delta_token_ids, s.finish_reason) for s in snaps], sample


@pytest.mark.parametrize("finish", [False, True])
def test_deferred_text_equals_engine_thread_text(tokenizer, finish):
    ids = tokenizer.encode("안녕하세요, 세계! 🙂🚀👍🏽 The end is near 🎉")
    finish_at = len(ids) - 1 if finish else None  # ends inside the last emoji's bytes
    now, sample = run_processor(tokenizer, SamplingParams(), ids, False, finish_at)
    later, deferred_sample = run_processor(tokenizer, SamplingParams(), ids, True, finish_at)
    assert deferred_sample.deferred and not sample.deferred
    assert later == now
    assert "".join(s[1] for s in later) == later[-1][0]


def test_stop_strings_stay_on_the_engine_thread(tokenizer):
    params = SamplingParams(stop=["STOP NOW"])
    ids = tokenizer.encode("then STOP NOW please and more")
    snaps, sample = run_processor(tokenizer, params, ids, True)
    assert not sample.deferred
    assert snaps[-1][0] == "then " and snaps[-1][3] == "stop"
    assert sum(len(s[2]) for s in snaps) < len(ids)  # the sequence ended at the stop string


@pytest.mark.parametrize("defer", [False, True])
def test_delta_snapshots_carry_the_step_and_end_whole(tokenizer, defer):
    """The server's snapshots: the same text and deltas as whole ones; an unfinished snapshot's
    token_ids and logprobs are its step's alone (never a growing copy), the final one whole."""
    params = SamplingParams(logprobs=1)
    ids = tokenizer.encode("안녕하세요, 세계! 🙂 and the rest of it")
    whole, delta = [], []
    a, _ = run_processor(tokenizer, params, ids, defer, len(ids), raw=whole)
    b, _ = run_processor(tokenizer, params, ids, defer, len(ids), delta=True, raw=delta)
    assert a == b and len(delta) == len(ids)
    for k, (w, d) in enumerate(zip(whole, delta)):
        assert w.token_ids == ids[: k + 1]
        assert [lp.logprob for lp in w.logprobs] == [-t / 1000 for t in ids[: k + 1]]
        if k + 1 < len(ids):
            assert d.token_ids == [ids[k]] == d.delta_token_ids
            assert [lp.token_id for lp in d.logprobs] == [ids[k]]
        else:
            assert d.finish_reason == "length"
            assert d.token_ids == ids and len(d.logprobs) == len(ids)
