"""A projection on paper, not a measurement: the reference job on 1-4 M4 Pro Macs over 10 GbE and Thunderbolt,
priced by the project's own models with every input stated below.

    python benchmarks/projection.py [--macs 1,2,3,4] [--rows 2000] [--json OUT] [--doc docs/projection.md]

Per Mac count: the model's layers split as the product splits them (`split.stage_shares`: by compute where every
stage of that split runs resident, else by bytes), each stage's price sheet on a 48 GB Mac (`prices.sheet_for`
through `schedule.policy_for`, Apple's reader settings) and the advisor's choice, resident or streamed
(`advisor.advise`); each stage priced by a pass model of its share (Apple's GPU rate, the Mac's disk);
the round of M micro-batches by the stage model (`stages.model`, hops by `link.Link`); the job by the estimate's
own scheduler (`simulate.simulate`), whose passes are the rounds, against the tightest stage's budget.
"""

import argparse
import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from spill import platform
from spill.admission import advisor, schedule
from spill.admission.passmodel import PassModel, PassShape
from spill.admission.simulate import SimRow, simulate
from spill.factory.families import get_family, tensor_shapes
from spill.factory.presets import Shape
from spill.stages.model import best_micro_batches, idle_shares, round_seconds
from spill.stages.split import stage_plans
from spill.streamer.plan import ModelPlan, TensorSpec, layer_of

# Llama-3.3-70B-Instruct's config.json (Meta's published shapes; no 70B config is in /work/shared/reference-data)
LLAMA_70B = Shape(hidden=8192, layers=80, intermediate=28672, heads=64, kv_heads=8, head_dim=128, vocab=128256)
DISK = 5.4e9               # bytes/s: the M4 Pro's disk probe (DESIGN.md §2)
WORKING_SET = "36GiB"      # Metal's recommended working set on a 48 GB Mac (3/4 of its memory); not measured here
MEMORY_BW = 273e9          # bytes/s: the M4 Pro's unified memory (Apple's figure): weights and KV through the GPU
# DESIGN.md §2b: a 70B bf16 pass at batch 150 has ~3 s of math: 2 x 70.6e9 params x 150 rows / 3 s
GPU_FLOPS = 2 * 70.6e9 * 150 / 3.0
# (name, one-way latency s, bytes/s): 10 GbE as a TCP ring sees it; Thunderbolt 4 and 5 bridges (IP over
# Thunderbolt) at half their 40 and 80 Gb/s link rates (Apple's figures; the half is an assumption, not measured)
LINKS = (("10 GbE", 1e-4, 1.1e9), ("TB4 bridge", 5e-5, 2.5e9), ("TB5 bridge", 5e-5, 5.0e9))
# the reference job: a three-tier mix like the reference run's (benchmarks/three_tier.py), max_tokens 128
TIERS = (45, 420, 900)
MAX_TOKENS = 128


def model_plan(shape: Shape = LLAMA_70B, itemsize: int = 2) -> ModelPlan:
    """The plan of a llama of `shape` in bf16 as its safetensors headers would give it; no file behind it."""
    config = {"model_type": "llama", "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
              "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
              "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "vocab_size": shape.vocab,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    layers: list[list[TensorSpec]] = [[] for _ in range(shape.layers)]
    resident, offset = [], 0
    for name, dims in tensor_shapes(get_family("llama"), shape, tied=False):
        n = itemsize
        for d in dims:
            n *= d
        t = TensorSpec(name, Path("model.safetensors"), offset, n, "BF16", dims)
        offset += n
        i = layer_of(name)
        (resident if i is None else layers[i]).append(t)
    return ModelPlan(Path("."), config, layers, resident)


def apple_pricing() -> None:
    """Price sheets as on Apple silicon: a GPU computing in the stored dtype, two read-ahead buffers and two layers
    in flight, read into MLX memory (so MLX's cache keeps a freed layer), no memory apart from the working set."""
    platform.use_device({"device": "gpu-apple", "memory": 0})
    os.environ.update(SPILL_READ_SLOTS="2", SPILL_LAYERS_IN_FLIGHT="2", SPILL_READ_INTO="mlx")


def stage_model(plan: ModelPlan, disk: float = DISK, flops: float = GPU_FLOPS, memory_bw: float = MEMORY_BW,
                resident: bool = False) -> PassModel:
    """A stage's pass model: a decode row or a prompt token costs 2 x its parameters at the GPU's rate, a token of
    context its share of the KV through memory; resident, a micro-batch takes its weights through memory."""
    params = sum(t.nbytes for ts in plan.layers for t in ts) // 2 + sum(t.nbytes for t in plan.resident) // 2
    kv_heads, head_dim = plan.kv_heads_and_dim
    per_token = 2 * params / flops
    return PassModel(disk, fixed_s=plan.total_bytes / memory_bw if resident else 0.0, per_row_s=per_token,
                     per_prefill_token_s=per_token,
                     per_context_token_s=len(plan.layers) * 2 * kv_heads * head_dim * 2 / memory_bw, overlap=1.0)


@dataclass
class Pipeline(PassModel):
    """A round of the pipeline priced as one pass (a row advances a token a round): the base terms pace prefill as
    a pass of the busiest stage's reads; `pass_s` is the stage model's round of `m` micro-batches."""
    stages: list = field(default_factory=list)    # (PassModel, bytes read a micro-batch visit (0: resident), its bytes)
    reads: int = 0                                # bytes the busiest stage reads a round: more, the first round
    hop: tuple = (0.0, 1.0)                       # the link's (latency s, bytes/s)
    hidden: int = 0
    m: int = 1

    def times(self, shape: PassShape) -> tuple[list[float], list[float]]:
        """(each stage's seconds for one micro-batch, each hop's): the shape cut in m equal parts."""
        m, first = self.m, shape.bytes_streamed > self.reads
        part = PassShape(shape.decode_rows / m, shape.prefill_tokens / m, shape.context_tokens / m, 0,
                         prefill_groups=shape.prefill_groups, prefill_context=shape.prefill_context / m)
        t = []
        for model, nbytes, share in self.stages:   # a resident stage reads its share once, in the first round
            read = nbytes or (share / m if first else 0)
            t.append(model.pass_s(replace(part, bytes_streamed=read)))
        latency, rate = self.hop
        tokens = (shape.decode_rows + shape.prefill_tokens) / m
        hops = [latency + tokens * self.hidden * 2 / rate] * (len(t) - 1) + [latency + shape.decode_rows / m * 4 / rate]
        return t, hops if len(t) > 1 else [0.0]

    def pass_s(self, shape: PassShape) -> float:
        return round_seconds(*self.times(shape), self.m)

    def roofline_s(self, shape: PassShape) -> float:
        return self.pass_s(shape)


def job_rows(rows: int, tiers=TIERS, out: int = MAX_TOKENS) -> list[SimRow]:
    """`rows` rows, the tiers in turn, each priced at its max_tokens."""
    return [SimRow(i, tiers[i % len(tiers)], out) for i in range(rows)]


def project(n: int, link: tuple, rows: list[SimRow], *, plan: ModelPlan | None = None, disk: float = DISK,
            working_set: str = WORKING_SET, flops: float = GPU_FLOPS, kv: tuple | None = None) -> dict:
    """The job on `n` Macs joined by `link` (name, latency s, bytes/s): each stage's share and mode, the round,
    rows a round, each stage's idle share and the job's seconds. `kv`: the pools' (bits, group size), None bf16."""
    plan = plan or model_plan()
    for by_compute in (True, False) if n > 1 else (False,):   # by compute where every stage runs resident so
        plans = stage_plans(plan, n, by_compute=by_compute)
        streamed = [stage_model(p, disk, flops) for p in plans]
        modes = [advisor.advise(p, rows, working_set, passes=s, kv=kv).resident for p, s in zip(plans, streamed)]
        if all(modes):
            break
    models = [stage_model(p, disk, flops, resident=r) for p, r in zip(plans, modes)]
    policies = [schedule.policy_for(p, working_set, s, resident=r, kv=kv) for p, s, r in zip(plans, models, modes)]
    mean = SimRow(-1, round(sum(r.prompt for r in rows) / len(rows)), MAX_TOKENS)
    held = [max_batch(mean) for _, _, max_batch in policies]
    sheets = [pol.sheet for pol, _, _ in policies]   # a row starts where every stage can hold it
    tight = min(range(n), key=lambda k: sheets[k].kv_budget / sheets[k].kv_per_token)
    policy, waiting, max_batch = policies[tight]
    reads = [0 if r else p.streamed_bytes for p, r in zip(plans, modes)]
    _, latency, rate = link
    batch = held[tight]
    hop_one = [latency + batch * plan.config["hidden_size"] * 2 / rate] * n
    m = 1 if n == 1 else best_micro_batches([s.fixed_s if r else b / disk for s, r, b in zip(models, modes, reads)],
                                            [s.per_row_s for s in models], hop_one, batch)
    whole = stage_model(plan, disk, flops)
    pipe = Pipeline(disk, **{k: getattr(whole, k) for k in ("per_row_s", "per_prefill_token_s", "per_context_token_s")},
                    overlap=1.0, stages=[(s, b, p.total_bytes) for s, b, p in zip(models, reads, plans)],
                    reads=m * max(reads), hop=(latency, rate), hidden=plan.config["hidden_size"], m=m)
    est = simulate(rows, policy, waiting, pipe, pipe.reads, max_batch=max_batch,
                   read_once=sum(p.total_bytes for p, r in zip(plans, modes) if r))
    running = sorted(sum(r.values()) for r in est.running)
    median = running[len(running) // 2]   # a typical round: the median rows and the mean prompt tokens a pass
    steady = PassShape(median, sum(est.prefill) // est.passes, int(median * (mean.prompt + MAX_TOKENS / 2)), pipe.reads)
    t, hops = pipe.times(steady)
    fill = sum(t[:-1]) + sum(hops[:-1])   # the first micro-batch's trip to the last stage, once (stages.model)
    return {"macs": n, "link": link[0] if n > 1 else "-", "micro_batches": m,
            "stage_gb": [round(p.total_bytes / 1e9, 1) for p in plans],
            "layers": [len(p.layers) for p in plans], "split": "compute" if by_compute else "bytes",
            "mode": ["resident" if r else "streamed" for r in modes],
            "budget_gib": round(policy.sheet.budget / 2**30, 2),
            "kv_budget_gib": [round(pol.sheet.kv_budget / 2**30, 2) for pol, _, _ in policies],
            "rows_held": held, "round_s": round(pipe.pass_s(steady), 2),
            "stage_s": [round(x, 3) for x in t], "hop_ms": [round(1e3 * h, 2) for h in hops],
            "idle": [round(x, 3) for x in idle_shares(t, hops, m)], "rows_per_pass": round(est.rows_per_pass, 1),
            "rows_most": running[-1], "rows_median": median,
            "passes": est.passes, "seconds": est.total_seconds + fill,
            "hours": round((est.total_seconds + fill) / 3600, 2)}


def table(results: list[dict]) -> str:
    head = ("| Macs | link | each stage's share (GB) | mode | M | rows a pass, most / median | round s "
            "| stage idle, most | hop ms, longest | hours |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in results:
        lines.append(f"| {r['macs']} | {r['link']} | {' / '.join(map(str, r['stage_gb']))} | {r['mode'][0]}"
                     f"{'' if len(set(r['mode'])) == 1 else ' (mixed)'} | {r['micro_batches']} "
                     f"| {r['rows_most']} / {r['rows_median']} | {r['round_s']} "
                     f"| {max(r['idle']):.1%} | {max(r['hop_ms'])} | **{r['hours']}** |")
    return "\n".join(lines)


def write_doc(path: Path, text: str, begin="<!-- projection:begin -->", end="<!-- projection:end -->") -> None:
    """Put `text` between the markers in `path`."""
    doc = path.read_text()
    a, b = doc.index(begin) + len(begin), doc.index(end)
    path.write_text(doc[:a] + "\n" + text + "\n" + doc[b:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--macs", default="1,2,3,4")
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--disk-gbps", type=float, default=DISK / 1e9)
    p.add_argument("--working-set", default=WORKING_SET, help="Metal's working set a Mac (36GiB on 48 GB)")
    p.add_argument("--kv-bits", type=int, default=0, help="the pools' KV at 8 or 4 bits, group 64 (0: bf16)")
    p.add_argument("--json", help="write every figure here too")
    p.add_argument("--doc", help="rewrite the table between this file's projection markers")
    args = p.parse_args()
    apple_pricing()
    rows, plan = job_rows(args.rows), model_plan()
    results = []
    for n in map(int, args.macs.split(",")):
        for link in LINKS[:1] if n == 1 else LINKS:
            results.append(project(n, link, rows, plan=plan, disk=args.disk_gbps * 1e9, working_set=args.working_set,
                                   kv=(args.kv_bits, 64) if args.kv_bits else None))
            print(json.dumps(results[-1]), file=sys.stderr)
    text = table(results)
    print(text)
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in results) + "\n")
    if args.doc:
        write_doc(Path(args.doc), text)


if __name__ == "__main__":
    main()
