"""How many prompt tokens a pass may carry, priced: chosen from the job's rows. Pure: no model.

Every prompt token a pass may prefill is priced in the sheet (its activations and its KV before the row joins
a pool), so each one priced is KV a running row cannot have. Fewer rows run at once with a large allowance;
rows join too slowly to fill the slots with a small one. A job advances, per pass, about

    min(rows the KV budget fits / mean max_tokens,  allowance / (1.25 x mean prompt))   rows

(a row holds its slot for about max_tokens passes; the pace aims 1.25x above what keeps the slots fed,
`schedule.need`). The choice is the allowance, halving from the most the budget priced down to LEAST, that
advances the most rows, the larger on a tie (the first slots fill sooner); a longer prompt still starts alone
and prefills over several passes. E.g. llama 3b on a 3 GiB GPU,
rows of 64 + 16 tokens: 109 / 143 / 160 rows fit at 2,048 / 1,024 / 512 tokens, so 6.8 / 8.9 / 6.4 rows a
pass: 1,024. A job whose rows all fit at the most keeps the most.
"""

from typing import Callable

from .prices import Sheet

SLACK = 1.25   # the pace's margin over what keeps the slots fed (schedule.need)
LEAST = 128    # prompt tokens a pass may carry, at the fewest


def choose(rows: list[tuple[int, int, int]], price: Callable[[int], Sheet], most: int, least: int,
           max_rows: int, reserved: int = 0) -> tuple[int, Sheet]:
    """(allowance, its sheet) for `rows`, each (prompt tokens, max_tokens, slot bytes); `price(tokens)`: the
    sheet with that allowance priced; `reserved`: KV the pools hold now, which a choice must leave room for."""
    best, best_rate = None, -1.0
    tokens = most
    while True:
        sheet = price(tokens)
        if sheet.kv_budget >= reserved:
            rate = advance(rows, sheet.kv_budget, tokens, max_rows)
            if rate > best_rate:
                best, best_rate = (tokens, sheet), rate
        if tokens <= least:
            break
        tokens = max(tokens // 2, least)
    return best if best is not None else (most, price(most))


def advance(rows: list[tuple[int, int, int]], kv_budget: int, tokens: int, max_rows: int) -> float:
    """Rows a pass advances on average at this allowance (the module docstring's rule)."""
    if not rows:
        return 0.0
    n = len(rows)
    prompt = sum(p for p, _, _ in rows) / n
    out = sum(max(o, 1) for _, o, _ in rows) / n
    slot = sum(s for _, _, s in rows) / n
    fit = min(n, max_rows, max(kv_budget, 0) // max(int(slot), 1))
    return min(fit / out, tokens / max(SLACK * prompt, 1e-9))
