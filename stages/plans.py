"""What rank 0 tells the other stages between passes: an op and its body, as msgpack.

    ["plan", {ids, prompts, lengths, ...}]    run this PassPlan (its rows struct-of-arrays, prompts packed int32)
    ["share", {plan, owners}]                 a replica: this PassPlan's rows whose owner (a rank each) is its own
    ["clear", None]                           drop every row (the group's reset)
    ["resident", true]  ["kv", [bits, group]] keep the layers, or stream them; the next rows' KV format
    ["load", {model, layers, dtype, ...}]     load a model: each rank its own [start, stop) of `layers` (or every
                                              layer: `replicas`)
    ["stop", None]                            this model is done (its stage closes)
    ["exit", None]                            leave (the group is going down)
"""

import msgpack

from spill.errors import SpillError
from spill.messages import RowSampling, pack_tokens, unpack_tokens
from spill.streamer.records import PassPlan, Row

OPS = ("load", "plan", "share", "clear", "resident", "kv", "stop", "exit")


def pack(op: str, body=None) -> bytes:
    if op not in OPS:
        raise ValueError(f"unknown stage op {op!r}")
    if op == "share":
        plan, owners = body
        body = {"plan": plan_body(plan), "owners": list(owners)}
    return msgpack.packb([op, plan_body(body) if op == "plan" else body], use_bin_type=True)


def unpack(data: bytes) -> tuple[str, object]:
    """(op, body): a PassPlan for "plan"; a SpillError for anything this version cannot read."""
    try:
        op, body = msgpack.unpackb(data, raw=False)
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}")
        if op == "share":
            return op, (plan_of(body["plan"]), body["owners"])
        return op, plan_of(body) if op == "plan" else body
    except Exception as err:  # noqa: BLE001 - msgpack and the fields raise several types for a foreign frame
        raise SpillError(f"a stage could not read rank 0's message ({type(err).__name__}: {err}); every host "
                         "of the group must run the same spill version") from None


def plan_body(plan: PassPlan) -> dict:
    rows = [r for r, _ in plan.start]
    prompts, lengths = pack_tokens([r.prompt for r in rows])
    return {"ids": [r.id for r in rows], "prompts": prompts, "lengths": lengths,
            "max_tokens": [r.max_tokens for r in rows], "widths": [r.width for r in rows],
            "groups": [g for _, g in plan.start], "eos": [sorted(r.eos_ids) for r in rows],
            "teacher": [list(r.teacher) if r.teacher is not None else None for r in rows],
            "sampling": [[r.sampling.temperature, r.sampling.top_p, r.sampling.top_k, r.sampling.seed] for r in rows],
            "chunks": [[g, n] for g, n in plan.chunks.items()], "drop": list(plan.drop),
            "finish": list(plan.finish), "pools": plan.pools, "rounds": plan.rounds}


def plan_of(body: dict) -> PassPlan:
    n = len(body["ids"])
    columns = ("lengths", "max_tokens", "widths", "groups", "eos", "teacher", "sampling")
    if any(len(body[k]) != n for k in columns):
        raise ValueError(f"{n} rows but columns of other lengths")
    start = [(Row(rid, prompt, max_tokens, RowSampling(*sampling), frozenset(eos),
                  tuple(teacher) if teacher is not None else None, width), group)
             for rid, prompt, max_tokens, width, group, eos, teacher, sampling in zip(
                 body["ids"], unpack_tokens(body["prompts"], body["lengths"]), *(body[k] for k in columns[1:]))]
    return PassPlan(start, {g: n for g, n in body["chunks"]}, body["drop"], body["finish"], body["pools"],
                    rounds=body["rounds"])
