"""Size presets: the layer shapes a generated model gets, shared by every family.

The big presets copy the layer shapes of real checkpoints (Llama-3.2-1B and -3B) so
streaming benchmarks move real amounts of bytes per layer. Their vocabulary is
smaller than the real one (32768, not 128256): the tokenizer is trained locally on
the Python standard library, which has too little text for a 128k-token BPE.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """The numbers that fix every tensor's shape."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def dims(self) -> dict[str, int]:
        """Named dimensions the family layer tables refer to."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "hidden": self.hidden, "vocab": self.vocab, "head_dim": self.head_dim,
            "q": q, "kv": kv, "qkv": q + 2 * kv,
            "ffn": self.intermediate, "ffn2": 2 * self.intermediate,
        }


SIZES: dict[str, Shape] = {
    # a few MB, generated in well under a second: unit tests
    "tiny": Shape(hidden=128, layers=4, intermediate=384, heads=4, kv_heads=2,
                  head_dim=32, vocab=2048),
    # ~30M parameters, 60-70 MB in bf16: integration tests, several shards
    "small": Shape(hidden=512, layers=8, intermediate=1536, heads=8, kv_heads=4,
                   head_dim=64, vocab=8192),
    # 48 thin layers, ~310M parameters, ~0.62 GB in bf16: a model twice a small cgroup that two CPU
    # cores compute in minutes (the job benchmark, benchmarks/job.py)
    "tall": Shape(hidden=768, layers=48, intermediate=2048, heads=12, kv_heads=4,
                  head_dim=64, vocab=8192),
    # wide feed-forward layers and one KV head, ~530M parameters, 2.1 GB in float32: the job benchmark's
    # model, twice a 1 GiB cgroup, where rows of 900 tokens still batch (18 KB of KV a token)
    "lean": Shape(hidden=1024, layers=36, intermediate=4096, heads=16, kv_heads=1,
                  head_dim=64, vocab=8192),
    # lean with 45 layers, 2.55 GiB in float32: twice a 1.25 GiB cgroup, the smallest in which the group's
    # processes (~0.75 GiB before any KV cache) leave the three-tier job's long rows room to batch
    "lean45": Shape(hidden=1024, layers=45, intermediate=4096, heads=16, kv_heads=1,
                    head_dim=64, vocab=8192),
    # Llama-3.2-1B layer shapes, 1.04B parameters, ~2.1 GB in bf16 (tied)
    "1b": Shape(hidden=2048, layers=16, intermediate=8192, heads=32, kv_heads=8,
                head_dim=64, vocab=32768),
    # Llama-3.2-3B layer shapes, 2.92B parameters, ~5.8 GB in bf16 (tied)
    "3b": Shape(hidden=3072, layers=28, intermediate=8192, heads=24, kv_heads=8,
                head_dim=128, vocab=32768),
    # many thin layers and one KV head, ~1.3 GB in bf16 (tied): a model larger than a small cgroup
    # whose fixed parts (a few layers in flight) and KV per token stay small
    "deep": Shape(hidden=768, layers=112, intermediate=2048, heads=12, kv_heads=1,
                  head_dim=64, vocab=8192),
}
