"""OpenBLAS threads against the reader's convert threads on the CPU: decode passes per setting.

    python benchmarks/cpu_threads.py [--size 3b] [--dtype bfloat16] [--batches 8,128] [--settings 0:8,8:8,12:4]

Each setting is BLAS:CONVERT (SPILL_BLAS_THREADS, 0 = OpenBLAS's default; SPILL_CONVERT_THREADS);
every batch runs one prefill pass and --passes decode passes per setting, in one process, against
the IO of one cold O_DIRECT read measured first (pass_time.py's way). Prints a table; writes none.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pass_time import GB, model_folder, read_direct, stream  # noqa: E402

from spill.platform import reexec_with_preload  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="/tmp/spill-bench")
    p.add_argument("--family", default="llama")
    p.add_argument("--size", default="3b")
    p.add_argument("--dtype", default="bfloat16", help="the stored dtype (float32 on a small CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batches", default="8,128")
    p.add_argument("--settings", default="0:8,8:8,12:4")
    p.add_argument("--passes", type=int, default=3)
    a = p.parse_args()
    reexec_with_preload(sys.argv)   # OpenBLAS must be loaded before MLX starts: re-exec once with it preloaded
    import mlx.core as mx
    import numpy as np
    mx.set_default_device(mx.cpu)
    folder = model_folder(a)
    files = sorted(folder.glob("*.safetensors"))
    bw = read_direct(files, 4)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(a.seed)
    batches = [int(b) for b in a.batches.split(",")]
    prompts = [rng.integers(100, vocab, rng.integers(12, 21)).tolist() for _ in range(max(batches))]
    cores = os.cpu_count()
    print(f"cold O_DIRECT read {bw:.2f} GB/s; {cores} cores", flush=True)
    rows = ["| batch | BLAS threads | convert threads | pass s | pass/IO | wait s | compute s (engine) | "
            "read s | convert s | read GB/s in pass | CPU: spill |", "|" + "---|" * 11]
    for b in batches:
        for setting in a.settings.split(","):
            blas, conv = setting.split(":")
            os.environ["SPILL_BLAS_THREADS"] = str(int(blas) or cores)
            os.environ["SPILL_CONVERT_THREADS"] = conv
            r = stream(folder, files, prompts, b, a.passes)
            io = r["streamed"] / (bw * GB)
            rows.append(f"| {b} | {int(blas) or cores} | {conv} | {r['pass']:.2f} | {r['pass'] / io:.2f} | "
                        f"{r['wait']:.2f} | {r['comp']:.2f} | {r['read']:.2f} | {r['conv']:.2f} | {r['gbps']:.2f} | "
                        f"{r['own']:.0%} |")
            print(rows[-1], flush=True)
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
