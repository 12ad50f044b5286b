"""A pass's TOKENS with several tokens of a row (drafts accepted): the row's text in order, a stop string inside
the run ends it once, and the live view names each row once."""

import numpy as np
from mlx_lm.tokenizer_utils import load as load_tokenizer

from spill import messages as m
from spill.tokenizer_worker.core import TokenizerCore
from spill.tokenizer_worker.process import _tokens


class Box:
    def __init__(self):
        self.sent = []

    def send(self, to, msg):
        self.sent.append((to, msg))


class Log:
    def warning(self, *a, **kw):
        raise AssertionError(f"no token should be lost: {a} {kw}")


def test_a_rows_run_of_tokens_is_its_text_in_order_and_a_stop_string_inside_it_ends_it_once(make_tiny):
    folder = make_tiny("llama")
    core, tok = TokenizerCore(folder), load_tokenizer(folder)
    words = tok.encode("The cat sat on the mat.", add_special_tokens=False)
    core.tokenize(0, m.RowRequest(kind="completion", prompt="x", max_tokens=50))
    core.tokenize(1, m.RowRequest(kind="completion", prompt="x", max_tokens=50, stop=["on the"]))
    rows = [0] * 3 + [1] * len(words)
    sent = words[:3] + words
    box = Box()
    _tokens(box, core, m.Tokens(1, 0, rows, np.array(sent, np.int32).tobytes(), [""] * len(rows),
                                list(range(3)) + list(range(len(words)))), "job", Log())
    kinds = {type(msg): msg for _, msg in box.sent}
    assert kinds[m.Stop].rows == [1]
    assert kinds[m.Done].rows == [1] and kinds[m.Done].texts == ["The cat sat "]
    assert kinds[m.Progress].rows == [0] and kinds[m.Progress].tokens == [3]
    assert core.finish(0, "length")[0] == tok.decode(words[:3])
