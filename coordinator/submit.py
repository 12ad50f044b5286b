"""What a submit checks and makes before the group queues a job: the job resumed or found (with every
setting it ran with), the model, the rows, room for the output, and only then a new job. A refusal
makes no job and no file."""

from dataclasses import dataclass
from pathlib import Path

from spill.errors import SpillError
from spill.memory import check_same, format_size
from spill.stages.split import stage_shares
from spill.streamer.plan import load_plan
from spill.streamer.shares import plan_kv_refusal
from spill.typed import AUTO_DRAFTS

from .batch_input import Request, read_batch
from .estimate import refusal
from .jobstore import Job, jobs_dir
from .models import check_room, output_bytes, resolve


@dataclass
class Submitted:
    job: Job
    args: dict                # the request's arguments, a resumed job's own filled in
    folder: Path              # the model's folder
    memory: dict              # args with the group's memory and budget_fraction, as the estimate prices them
    requests: list[Request]
    bad: list                 # lines that cannot run: an error line each
    params: dict              # what job.json keeps: max_tokens, temperature and the SETTINGS


def prepare(args: dict, group_args: dict, ready_rss: dict, embedded: bool) -> Submitted:
    """Everything a submit needs, in the order that leaves nothing behind when one step refuses."""
    job = Job.open(args["resume"]) if args.get("resume") else None
    if job is not None:   # the job knows its input, model, output and settings
        args = resumed(job, args)
        check_settings(group_args, job)
    check_same(group_args, args)
    folder, mem = resolve(args["model"]), {**args, **{k: group_args.get(k) for k in ("memory", "budget_fraction")}}
    if short := refusal(folder, mem, ready_rss):   # no row would fit: no job is made, no output claimed
        raise SpillError(short + ("" if embedded else "; this group keeps the memory it was started with: "
                                  "`spill down`, then `spill up` with more"))
    requests, bad = read_batch(Path(args["input"]))
    params = {"max_tokens": 256 if args.get("max_tokens") is None else args["max_tokens"],
              "temperature": args.get("temperature") or 0.0, "stream": bool(args.get("stream")),
              **{k: group_args.get(k) for k in ("memory", "budget_fraction")}, **kv_settings(args, group_args, folder),
              "speculate": speculate_setting(args, group_args), "draft": draft_setting(args, group_args, folder)}
    if why := draft_refusal(params["draft"], params["speculate"]) or ranks_refusal(args, group_args, folder, params):
        raise SpillError(why)
    mem.update((k, params[k]) for k in ("kv_bits", "kv_group_size"))   # the KV format its estimate prices
    output = Path(args["output"]) if args.get("output") else None
    if job is None and not args.get("new"):
        job = Job.find(Path(args["input"]), output, args["model"])
    check_room(job.output_path if job else output or jobs_dir(), output_bytes(len(requests), params["max_tokens"]),
               "the job's output may need", "there, or write it elsewhere with -o")
    if job is None:
        job = Job.create(Path(args["input"]), args["model"], params, output)
    job.check_input()
    return Submitted(job, args, folder, mem, requests, bad, params)


def resumed(job: Job, args: dict) -> dict:
    """A resume's arguments: what the command gave, else what the job ran with."""
    settings = job.settings()
    return {**args, "input": args.get("input") or job.meta["input"], "model": args.get("model") or job.meta["model"],
            "output": args.get("output") or job.meta.get("output"),
            "stream": bool(args.get("stream") or settings.get("stream")),
            **{k: settings[k] if k in settings else args.get(k) for k in ("kv_bits", "kv_group_size", "speculate", "draft")}}


def speculate_setting(args: dict, group_args: dict) -> int:
    """The job's --speculate, else the group's (`spill up`), else auto."""
    given = next((d["speculate"] for d in (args, group_args) if d.get("speculate") is not None), None)
    return AUTO_DRAFTS if given is None else given


def ranks_refusal(args: dict, group_args: dict, folder: Path, params: dict) -> str | None:
    """Why the job cannot run on this group's pipeline (another --ranks or --micro-batches, more ranks than layers,
    drafts), or None."""
    ranks, now = group_args.get("ranks") or 1, group_args.get("stages") or 1
    if args.get("ranks") and args["ranks"] != ranks:
        return (f"the running group runs {ranks} rank(s); run without --ranks, or `spill down` and run again to "
                f"start a group of {args['ranks']}")
    if args.get("micro_batches") is not None and args["micro_batches"] != (group_args.get("micro_batches") or 0):
        return (f"the running group runs --micro-batches {group_args.get('micro_batches') or 0}; run without "
                f"--micro-batches, or `spill down` and run again to start a group with {args['micro_batches']}")
    if now == 1:
        return None
    try:
        stage_shares(load_plan(folder), now)
    except SpillError as err:
        return str(err)
    if params["draft"] or params["speculate"] > 0:
        return (f"drafts are not verified across the ranks of a group yet and this group runs {now} ranks; run with "
                "--speculate off and no --draft, or on a group of one rank")
    return None


def draft_setting(args: dict, group_args: dict, folder: Path) -> str | None:
    """The job's --draft, else the group's (`spill up`), resolved as MODEL is and checked against it; None: none."""
    given = next((d["draft"] for d in (args, group_args) if d.get("draft")), None)
    if given is None:
        return None
    draft = resolve(given)
    if why := vocabulary_refusal(folder, draft, given):
        raise SpillError(why)
    return str(draft)


def draft_refusal(draft: str | None, speculate: int) -> str | None:
    """Why a draft model has no drafts to give (--draft with --speculate off), or None."""
    if draft and not speculate:
        return "--draft proposes the drafts --speculate carries, which is off; add --speculate K, or leave --draft out"
    return None


def vocabulary_refusal(target: Path, draft: Path, name: str) -> str | None:
    """Why `draft` cannot propose tokens for `target` (their tokenizers' vocabularies differ), or None."""
    mine, theirs = vocabulary(draft), vocabulary(target)
    if None in (mine, theirs):   # a tokenizer without tokenizer.json: the configs' sizes
        mine, theirs = (dict.fromkeys(range(int(load_plan(f).config.get("vocab_size") or 0))) for f in (draft, target))
    if mine == theirs:
        return None
    return (f"--draft {name}: its vocabulary ({len(mine)} tokens) differs from the model's ({len(theirs)} tokens); "
            "give --draft a smaller model that shares the model's tokenizer (the same family), or leave --draft out")


def vocabulary(folder: Path) -> dict | None:
    """A model's tokens -> ids as its tokenizer.json has them (added tokens included); None without one."""
    if not (folder / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(with_added_tokens=True)


def kv_settings(args: dict, group_args: dict, folder: Path) -> dict:
    """The job's --kv-bits and --kv-group-size, else the group's (`spill up`), checked against the model."""
    given = args if args.get("kv_bits") else group_args
    bits, group = given.get("kv_bits") or None, given.get("kv_group_size") or 64
    if bits and (why := plan_kv_refusal(bits, group, load_plan(folder))):
        raise SpillError(why)
    return {"kv_bits": bits, "kv_group_size": group}


def check_settings(group_args: dict, job: Job) -> None:
    """A resumed job runs with the memory it was started with, or not at all (a --memory set to share the machine)."""
    settings = job.settings()
    for key, flag in (("memory", "--memory"), ("budget_fraction", "--budget-fraction")):
        if key in settings and settings[key] != group_args.get(key):
            show = lambda v: "none" if v is None else format_size(v) if key == "memory" else v   # noqa: E731
            raise SpillError(f"job {job.id} ran with {flag} {show(settings[key])} but the running group was "
                             f"started with {flag} {show(group_args.get(key))}; `spill down`, then "
                             f"`spill run --resume {job.id}` runs it with its own settings")
