"""How a pass shares its prompt tokens among prefilling rows, and which new rows prefill together: pure
rules without MLX, so admission's schedule and estimate (processes that never compute) follow the
streamer's own."""

MIN_CHUNK = 32   # prompt tokens a prefilling row advances a pass, at least


def chunk_for(budget: int, rows: int, largest: int) -> int:
    """Prompt tokens each of `rows` prefilling rows advances in a pass that may prefill `budget`
    tokens in all: an equal share, at least MIN_CHUNK (so a prompt always moves), at most `largest`."""
    return max(1, min(largest, max(MIN_CHUNK, budget // max(rows, 1))))


def prefill_width(lengths: list[int]) -> int:
    """A prefill group's padded width: its longest prompt (each layer's KV is allocated at it, once)."""
    return max(lengths, default=0)


def prefill_kv_tokens(lengths: list[int]) -> int:
    """Token columns of KV a prefill group allocates in every layer on its first chunk (Group.prefill
    allocates exactly this; the scheduler prices exactly this)."""
    return len(lengths) * prefill_width(lengths)


def bucket(rows: list, max_rows: int = 64, slack: float = 1.25, length=lambda r: len(r.row.prompt)) -> list[list]:
    """Split new rows into prefill groups of similar prompt length, so padding stays small
    (`length(row)`: its prompt's; the estimate groups its rows by the same rule)."""
    out: list[list] = []
    for r in sorted(rows, key=length):
        if out and len(out[-1]) < max_rows and length(r) <= slack * length(out[-1][0]) + 8:
            out[-1].append(r)
        else:
            out.append([r])
    return out
