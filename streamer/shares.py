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


KV_BITS, KV_GROUP_SIZES = (8, 4), (32, 64, 128)


def kv_fields(head_dim: int, itemsize: int, bits: int | None = None, group_size: int = 64) -> dict[str, tuple]:
    """One token's K (or V) of one head as the decode pool stores it: field -> (values, itemsize). Unquantized,
    head_dim floats; quantized (MLX's affine format), head_dim x bits packed in uint32 and a scale and a bias
    (compute dtype) per group of `group_size` along head_dim."""
    if bits is None:
        return {"values": (head_dim, itemsize)}
    return {"packed": (head_dim * bits // 32, 4), "scales": (head_dim // group_size, itemsize),
            "biases": (head_dim // group_size, itemsize)}


def kv_token_bytes(layers: int, kv_heads: int, head_dim: int, itemsize: int, bits: int | None = None,
                   group_size: int = 64) -> int:
    """Bytes of K and V one token holds in a decode pool, every layer (kvquant.QuantPool allocates by kv_fields)."""
    per_head = sum(n * size for n, size in kv_fields(head_dim, itemsize, bits, group_size).values())
    return layers * 2 * kv_heads * per_head


def kv_setting(args: dict) -> tuple[int, int] | None:
    """A job's quantized KV from its arguments (kv_bits, kv_group_size): (bits, group size); None: unquantized."""
    return (args["kv_bits"], args.get("kv_group_size") or 64) if args.get("kv_bits") else None


def kv_format(bits: int | None, group_size: int = 64) -> str:
    """The decode pools' KV format as the job's summary, status and metrics name it."""
    return "unquantized" if bits is None else f"{bits}-bit (group {group_size})"


# families whose mlx-lm attention reads the cache's keys itself, not through MLX's attention, where quantized KV goes
NO_QUANTIZED_KV = {"gemma2": "gemma2's attention (soft-capped) reads the cache's keys itself"}


def kv_refusal(bits: int | None, group_size: int, head_dim: int | None = None, model_type: str | None = None) -> str | None:
    """The sentence a KV setting this model or MLX cannot take is refused with, else None."""
    if bits is None:
        return None
    if model_type in NO_QUANTIZED_KV:
        return f"--kv-bits {bits}: {NO_QUANTIZED_KV[model_type]}, where quantized KV cannot go; leave --kv-bits out"
    if bits not in KV_BITS:
        return f"--kv-bits {bits} is not one of {', '.join(map(str, KV_BITS))}; pick one or leave it out (unquantized)"
    if group_size not in KV_GROUP_SIZES:
        return f"--kv-group-size {group_size} is not one of {', '.join(map(str, KV_GROUP_SIZES))}; pick one of them"
    if head_dim is not None and head_dim % group_size:
        fits = [g for g in KV_GROUP_SIZES if head_dim % g == 0]
        fix = f"use --kv-group-size {fits[-1]}" if fits else "leave --kv-bits out for this model"
        return f"--kv-group-size {group_size} does not divide the model's head dimension {head_dim}; {fix}"
    return None


def plan_kv_refusal(bits: int | None, group_size: int, plan) -> str | None:
    """kv_refusal for the model a load plan read (its head dimension and family)."""
    return kv_refusal(bits, group_size, plan.kv_heads_and_dim[1], plan.config.get("model_type"))
