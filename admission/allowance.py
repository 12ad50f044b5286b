"""How many prompt tokens a pass may carry, priced: chosen from the job's rows. Pure: no model.

Every prompt token a pass may prefill is priced in the sheet (its activations and its KV before the row joins
a pool), so each one priced is KV a running row cannot have. Fewer rows run at once with a large allowance;
rows join too slowly to fill the slots with a small one. The job of n rows takes about

    max(n x 1.25 x mean prompt / allowance,  n x mean max_tokens / rows the KV budget fits)
      + rows that fit x 1.25 x mean prompt / allowance                                        passes

(rows start as fast as the allowance lets them, 1.25x what keeps the slots fed as the pace aims, `schedule.need`,
or hold a slot for about max_tokens passes; and the slots fill first). The choice is the allowance, halving from
the most the budget priced down to LEAST, with the fewest passes, the larger on a tie; a longer prompt still starts
alone and prefills over several passes. E.g. llama 3b on a 3 GiB GPU, 256 rows of 64 + 16 tokens: 109 / 143 / 160
rows fit at 2,048 / 1,024 / 512 tokens, so 42 / 40 / 65 passes: 1,024. A pass's time is taken as the same at any
batch (its read): on a compute-bound CPU more rows cost more, and the choice gains less.
"""

from typing import Callable

from .prices import Sheet

SLACK = 1.25   # the pace's margin over what keeps the slots fed (schedule.need)
LEAST = 128    # prompt tokens a pass may carry, at the fewest


def choose(rows: list[tuple[int, int, int]], price: Callable[[int], Sheet], most: int, least: int,
           max_rows: int, reserved: int = 0) -> tuple[int, Sheet]:
    """(allowance, its sheet) for `rows`, each (prompt tokens, max_tokens, slot bytes); `price(tokens)`: the
    sheet with that allowance priced; `reserved`: KV the pools hold now, which a choice must leave room for."""
    best, fewest = None, float("inf")
    tokens = most
    while True:
        sheet = price(tokens)
        if sheet.kv_budget >= reserved and (n := passes(rows, sheet.kv_budget, tokens, max_rows)) < fewest:
            best, fewest = (tokens, sheet), n
        if tokens <= least:
            break
        tokens = max(tokens // 2, least)
    return best if best is not None else (most, price(most))


def passes(rows: list[tuple[int, int, int]], kv_budget: int, tokens: int, max_rows: int) -> float:
    """The passes the job of `rows` takes at this allowance (the module docstring's rule)."""
    if not rows:
        return 0.0
    n = len(rows)
    start = SLACK * sum(p for p, _, _ in rows) / n / tokens   # passes a row's prompt holds the allowance
    out = sum(max(o, 1) for _, o, _ in rows) / n
    fit = min(n, max_rows, max(kv_budget, 0) // max(sum(s for _, _, s in rows) // n, 1))
    return max(n * start, n * out / fit) + fit * start if fit else float("inf")
