"""Which shapes MLX's quantized matmul runs on this device for attention over quantized KV: at each group size and
bit width, a pool's live columns as spill fetches them (a slice of wider arrays) and copied contiguous.

    python benchmarks/device/kv_probe.py

Prints one line per case: `ok`, or the first line of MLX's error.
"""

import mlx.core as mx


def attend(rows: int, tokens: int, group: int, bits: int, contiguous: bool, dtype=mx.bfloat16) -> None:
    stored = mx.quantize(mx.random.normal((rows, 4, tokens + 9, 64)).astype(dtype), group_size=group, bits=bits)
    live = tuple(x[:, :, :tokens] for x in stored)
    if contiguous:
        live = tuple(mx.contiguous(x) for x in live)
    kv = tuple(mx.expand_dims(x, 2) for x in live)   # 4 KV heads, 2 queries each
    q = mx.random.normal((rows, 4, 2, 1, 64)).astype(dtype)
    scores = mx.quantized_matmul(q, *kv, transpose=True, group_size=group, bits=bits)
    mx.eval(mx.quantized_matmul(mx.softmax(scores, axis=-1), *kv, transpose=False, group_size=group, bits=bits))


def main() -> None:
    print("mlx", mx.__version__, mx.default_device())
    for group in (32, 64):
        for bits in (8, 4):
            for rows, tokens in ((4, 25), (64, 67), (128, 130)):
                for contiguous in (False, True):
                    try:
                        attend(rows, tokens, group, bits, contiguous)
                        result = "ok"
                    except (RuntimeError, ValueError) as err:
                        result = str(err).splitlines()[0][:110]
                    how = "contiguous" if contiguous else "sliced"
                    print(f"group {group} bits {bits} rows {rows} tokens {tokens} {how}: {result}", flush=True)


if __name__ == "__main__":
    main()
