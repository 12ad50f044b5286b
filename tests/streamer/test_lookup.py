"""Prompt lookup drafts from hand-written histories, and the incremental index against a rescan."""

import numpy as np
import pytest

from spill.streamer.lookup import History, Outputs

W = {w: i for i, w in enumerate("the cat sat . ran on a mat dog".split())}


def ids(text: str) -> list[int]:
    return [W[w] for w in text.split()]


def words(tokens) -> str:
    names = {i: w for w, i in W.items()}
    return " ".join(names[t] for t in tokens)


def rescan(tokens: list[int], k: int) -> list[int]:
    """The rule read plainly: the latest earlier match of the last 3, 2, 1 tokens, what followed it."""
    for n in range(min(3, len(tokens)), 0, -1):
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == tokens[-n:]:
                return tokens[end + 1:end + 1 + k]
    return []


def test_the_latest_earlier_match_of_the_longest_suffix_proposes_what_followed_it():
    h = History(ids("the cat sat . the cat ran . the cat"))
    assert words(h.propose(4)) == "ran . the cat"
    assert words(h.propose(2)) == "ran ."
    h.extend(ids("sat on"))   # "cat sat on" never came before; "sat on" neither; "on" neither
    assert h.propose(4) == []
    h.extend(ids("a mat . the"))   # ". the" last at 7-8: "cat"
    assert words(h.propose(3)) == "cat sat on"   # ". the cat" at 7-9 is the latest ". the": what follows 9


def test_a_shorter_suffix_is_tried_when_the_longer_never_came_before():
    h = History(ids("a dog sat on a mat . the dog"))
    assert words(h.propose(3)) == "sat on a"   # "the dog" is new, "dog" came at 1
    assert History(ids("dog")).propose(3) == [] and History([]).propose(3) == []
    assert History(ids("dog dog")).propose(3) == ids("dog")   # the match may run into the suffix itself


def test_the_prompt_alone_proposes_when_the_output_is_not_indexed():
    h = History(ids("the cat sat on a mat"), index_output=False)
    h.extend(ids(". the dog . the"))
    assert words(h.propose(2)) == "cat sat"   # ". the" from the output is not a source, "the" from the prompt is
    assert words(History(ids("the cat sat on a mat . the dog . the")).propose(2)) == "dog ."


@pytest.mark.parametrize("seed", range(6))
def test_the_incremental_index_proposes_what_a_rescan_finds(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 4 + seed, 300).tolist()
    h = History(tokens[:40])
    for i in range(40, len(tokens), 3):
        h.extend(tokens[i:i + 3])
        assert h.propose(5) == rescan(tokens[:i + 3], 5)


def test_finished_outputs_propose_where_the_rows_own_tokens_do_not():
    outputs = Outputs()
    outputs.add(ids("a dog sat on the mat"))
    h = History(ids("the cat ran . a dog"))
    assert words(h.propose(3, outputs)) == "sat on the"      # "a dog" never came before in the row
    assert words(h.propose(3)) == ""
    outputs.add(ids("the cat ran . on a mat"))
    mine = History(ids("a cat ran . on a dog ran . on"))
    assert words(mine.propose(2, outputs)) == "a dog"        # the row's own ". on" first
    assert words(History(ids("dog ran . the cat ran")).propose(2, outputs)) == ". on"  # 3 tokens elsewhere beat 1 here


def test_outputs_keep_the_newest_within_their_capacity():
    outputs = Outputs(capacity=20)
    for i in range(10):
        outputs.add([i, 50 + i, 60 + i])
    assert len(outputs) <= 20
    assert outputs.follow(9, 1, 2) == [59, 69]
    assert outputs.follow(0, 1, 2) == []


def test_token_ids_past_the_packing_are_refused_with_the_limit():
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2097152\)"):
        History([1, 1 << 22, 3])
