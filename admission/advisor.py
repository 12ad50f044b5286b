"""The advisor: whether a job runs resident (every layer kept in memory after its first read, so
later passes read nothing) or streamed, decided once per job before its first pass from the
budget's own prices (`schedule.budget_policy`); and, where the model does not fit, a quantized
variant that would. Pure: no sockets.

    replicas   several ranks, each holding the whole model and a share of the job's batch at once:
               every rank runs every layer on its own rows (no pipeline bubble, no hidden states
               between hosts), so N replicas beat N stages wherever they fit
    resident   the weights, priced as a fixed part, leave KV for the job's batch (its rows, at
               most SPILL_MAX_ROWS, each at the job's longest prompt + max_tokens), or for a
               smaller batch that the pass model still rates faster than streaming (several
               ranks: a pipeline, each stage its share of the layers)
    streamed   otherwise, or when SPILL_STREAM / --stream asks for it
"""

from dataclasses import dataclass

from spill import memory
from spill.stages.model import micro_batches as micro_batches_of, pass_seconds
from spill.streamer.plan import ITEMSIZE, ModelPlan, TensorSpec

from .passmodel import PassModel, PassShape
from .policy import width_class
from .prices import fmt
from .schedule import budget_policy, hop_for


@dataclass
class Advice:
    resident: bool
    line: str                 # what `spill run` and `spill estimate` print
    weights: int = 0          # bytes the weights hold when resident
    kv: int = 0               # the job's KV at its whole batch
    budget: int = 0
    slots: int = 0            # rows the resident budget runs at once
    by_compute: bool = False  # a resident pipeline's layers split by compute, else by bytes (`split.stage_shares`)
    replicas: bool = False    # several ranks: each the whole model, resident, and a share of the rows (stages/replicas.py)

    @property
    def mode(self) -> str:
        return "resident" if self.resident else "streamed"


def advise(plan: ModelPlan, rows: list, memory_arg=None, *, stream: bool = False,
           passes: PassModel | None = None, variants: list[tuple[str, int, int]] = (), others: int = 0,
           fraction: float | None = None, kv: tuple | None = None, stages: int = 1, micro_batches: int = 0,
           rounds: int = 1, stage_scale: float = 1.0, hosts=(), replicas: bool = True) -> Advice:
    """`rows`: the job's SimRows (prompt, out); `passes`: the calibrated pass model, to weigh a resident
    batch smaller than the job's; `variants`: (tag, bits, group size) of quantized variants to name;
    `others`: the group's processes' resident memory, as admission prices it; `fraction`: --budget-fraction;
    `kv`: the pools' KV quantization (bits, group size), None unquantized; `stages`: a pipeline's ranks (each
    stage's share priced, resident where the tightest's fits, its layers split by compute where that fits; a
    smaller resident batch rated as its stages run it: `micro_batches` M, `rounds` a pass, stages/model.py, times
    `stage_scale`, what such passes took over that price, `Calibration.stage_scale`); `hosts`: each follower's
    (working set, budget fraction), its stage priced against them (`schedule.budget_policy`); `replicas`: several
    ranks may run as replicas, each the whole model and a share of the rows, where the job's batch fits so."""
    width = width_class(max((r.prompt + r.out for r in rows), default=1))
    streamed = budget_policy(plan, memory_arg, fraction, others=others, kv=kv, stages=stages, hosts=hosts)[0]
    want = max(1, min(len(rows), streamed.max_rows))
    streamed_slots = _slots(streamed, want, width)
    own = (memory.working_set(memory_arg).bytes, fraction or memory.default_fraction())   # rank 0's
    apart = any(tuple(h[:2]) != own for h in hosts[:stages - 1])   # a follower's host with a budget of its own
    if stages > 1 and replicas and not stream and (
            chosen := _replicas(plan, memory_arg, fraction, others, kv, stages, hosts, want, width, apart)):
        return chosen

    def resident(by_compute: bool):   # (policy, working set, slots, fits) with every stage's layers kept
        policy, ws = budget_policy(plan, memory_arg, fraction, others=others, resident=True, kv=kv, stages=stages,
                                   by_compute=by_compute, hosts=hosts)
        slots = _slots(policy, want, width)
        faster = 0 < slots < want and _faster(passes, plan, slots, streamed_slots, rows,
                                              (stages, micro_batches_of(micro_batches, stages), rounds, stage_scale,
                                               hop_for(plan, hosts)))
        return policy, ws, slots, slots >= want or faster

    # a resident pipeline's stages split by compute where they fit so, else by bytes (the least on any stage)
    by_compute = stages > 1
    policy, ws, slots, fits = resident(by_compute)
    if by_compute and not fits:
        by_compute = False
        policy, ws, slots, fits = resident(by_compute)
    s = policy.sheet
    weights, held = s.fixed["resident"], s.cost(want, width)
    split = f"; layers split by {'compute' if by_compute else 'bytes'}" if fits and not stream else ""
    budget = f"the {fmt(s.budget)} memory budget" + (
        "" if stages == 1 else f" of each of {stages} ranks (the tightest stage's share{split})" if not apart else
        f" of {ws.source if ws.source.startswith('rank') else 'rank 0'}, the tightest of {stages} ranks' shares, each "
        f"against its own host's budget{split}")
    what = (f"the weights ({fmt(weights)}) and the job's KV ({fmt(held)} for {want} rows at once) fit {budget}"
            if slots >= want else
            f"the weights ({fmt(weights)}) leave KV for {slots} of the job's {want} rows at once in {budget}, "
            f"faster by the pass model than streaming {streamed_slots} at once")
    if fits and stream:
        line = f"streamed (--stream or SPILL_STREAM), though resident would fit: {what}"
    elif fits:
        line = f"resident: {what}; only the first pass reads the disk (--stream streams every pass)"
    else:
        line = (f"streamed: resident, the weights ({fmt(weights)}), the job's KV ({fmt(held)} for {want} rows at once) "
                f"and the buffers and activations ({fmt(sum(s.fixed.values()) - weights)}) would need more than "
                f"{budget} ({s.fraction:.0%} of the {fmt(ws.bytes)} working set)")
        if tag := _variant(plan, rows, memory_arg, passes, variants, others, fraction, kv):
            line += f"; {tag} would fit resident: spill run {tag}"
    return Advice(fits and not stream, line, weights, held, s.budget, slots, by_compute and fits and not stream)


def _replicas(plan, memory_arg, fraction, others, kv, stages, hosts, want, width, apart) -> Advice | None:
    """Replicas' advice where the whole model and a 1/stages share of the job's batch fit every rank's budget."""
    policy, ws = budget_policy(plan, memory_arg, fraction, others=others, resident=True, kv=kv, stages=stages,
                               hosts=hosts, replicas=True)
    if _slots(policy, want, width) < want:
        return None
    s = policy.sheet
    weights, held = s.fixed["resident"], s.cost(want, width)
    where = (f"{ws.source if ws.source.startswith('rank') else 'rank 0'}, the tightest of {stages} ranks" if apart else
             f"each of {stages} ranks")
    line = (f"replicas: the whole model ({fmt(weights)}) and a 1/{stages} share of the job's KV ({fmt(held)}, "
            f"{-(-want // stages)} of its {want} rows at once) fit the {fmt(s.budget)} memory budget of {where}; each "
            "rank runs every layer on its own share of the rows, with no pipeline to fill and drain and no hidden states "
            "between hosts; only the first pass reads the disk (--stream streams a pipeline instead)")
    return Advice(True, line, weights, held, s.budget, want, replicas=True)


def _slots(policy, want: int, width: int) -> int:
    s = policy.sheet
    return min(want, max(s.kv_budget, 0) // s.cost(1, width))


def _faster(passes: PassModel | None, plan: ModelPlan, resident: int, streamed: int, rows: list,
            pipeline: tuple = (1, 1, 1, 1.0, None)) -> bool:
    """Tokens per second of a decode pass at each batch, by the pass model (resident reads nothing); a resident
    pipeline's (stages, micro-batches, rounds, scale, hop) as `pass_seconds` prices it times the scale, a streamed
    one's as one process's."""
    if passes is None or not rows:
        return False
    context = sum(r.prompt + r.out / 2 for r in rows) / len(rows)
    stages, m, rounds, scale, hop = pipeline

    def rate(batch: int, nbytes: int) -> float:
        shape = PassShape(batch, 0, int(batch * context), nbytes)
        if stages > 1 and not nbytes:
            seconds = pass_seconds(passes, shape, stages, m, rounds, hop) * scale
            return batch * rounds / max(seconds, 1e-12) if batch else 0.0
        return batch / max(passes.pass_s(shape), 1e-12) if batch else 0.0
    return rate(resident, 0) > rate(streamed, plan.streamed_bytes)


def _variant(plan, rows, memory_arg, passes, variants, others, fraction=None, kv=None) -> str:
    """The first variant (most bits first) that would run resident, priced from this model's shapes."""
    if plan.config.get("quantization"):
        return ""
    for tag, bits, group in sorted(variants, key=lambda v: -v[1]):
        if advise(quantized(plan, bits, group), rows, memory_arg, passes=passes, others=others, fraction=fraction,
                  kv=kv).resident:
            return tag
    return ""


def quantized(plan: ModelPlan, bits: int, group_size: int = 64) -> ModelPlan:
    """The plan of this model MLX-quantized (mlx-community layout): each 2-D float weight whose rows
    split into groups becomes packed uint32 plus scales and biases in its own dtype, per group."""
    def one(t: TensorSpec) -> list[TensorSpec]:
        if len(t.shape) != 2 or not t.name.endswith(".weight") or t.shape[1] % group_size or t.dtype not in (
                "BF16", "F16", "F32"):
            return [t]
        rows, cols = t.shape
        base, per = t.name[:-len("weight")], ITEMSIZE[t.dtype] * rows * cols // group_size
        return [TensorSpec(t.name, t.path, 0, rows * cols * bits // 8, "U32", (rows, cols * bits // 32)),
                TensorSpec(base + "scales", t.path, 0, per, t.dtype, (rows, cols // group_size)),
                TensorSpec(base + "biases", t.path, 0, per, t.dtype, (rows, cols // group_size))]
    return ModelPlan(plan.folder, {**plan.config, "quantization": {"bits": bits, "group_size": group_size}},
                     [[q for t in ts for q in one(t)] for ts in plan.layers], [q for t in plan.resident for q in one(t)])
