"""Incremental detokenization and stop strings."""

from mlx_lm.tokenizer_utils import load as load_tokenizer

from spill.streamer.core import Row, Streamer
from spill.tokenizer_worker.text import RowText


def test_text_matches_decode_and_stops_before_the_stop_string(make_tiny):
    tok = load_tokenizer(make_tiny("llama"))
    ids = tok.encode("The lighthouse keeper found a bottle. Inside was a map.", add_special_tokens=False)
    whole = RowText(tok)
    for t in ids:
        assert not whole.add(t)
    assert whole.finish() == tok.decode(ids)

    row = RowText(tok, stop=["bottle", "never"])
    stopped_at = next(k for k, t in enumerate(ids) if row.add(t))
    assert row.finish() == "The lighthouse keeper found a "
    assert "bottle" in tok.decode(ids[: stopped_at + 1])


def test_a_stop_string_ends_a_streamed_row(make_tiny):
    folder = make_tiny("qwen2")
    tok = load_tokenizer(folder)
    prompt = tok.encode("Tell me a story.")
    free = Streamer(folder)
    free.add(Row("a", prompt, 10))
    tokens = []
    while not free.idle:
        tokens += [e.token for e in free.step().emitted]
    full = tok.decode(tokens)
    stop = full[len(full) // 2: len(full) // 2 + 2]  # two characters from the middle of the text
    assert stop.strip(), full

    s, text, emitted = Streamer(folder), RowText(tok, stop=[stop]), 0
    s.add(Row("a", prompt, 10))
    while not s.idle:
        for e in s.step().emitted:
            emitted += 1
            if text.add(e.token):
                s.finish("a")
    assert text.finish() == full[: full.index(stop)]
    assert emitted < len(tokens)
