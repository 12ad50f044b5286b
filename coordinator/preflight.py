"""What `spill run` checks before it starts or reaches a group, in a fraction of a second and without
MLX: the flag values, the model folder, the input file, the output path, and whether the same command
already finished. The group checks them again; this is so that a mistake is refused at once."""

from pathlib import Path

from spill.errors import SpillError

from .batch_input import check_params, read_batch
from .jobstore import Job, check_output_free


def check_flags(**values) -> None:
    """--max-tokens and --temperature get the checks and the wording a row's fields get."""
    errs = check_params({k: v for k, v in values.items() if v is not None})
    if errs:
        raise SpillError("; ".join("--" + e.replace("_", "-", e.index(" ")) for e in errs))


def local_model(model: str) -> str:
    """MODEL as the group should see it: a folder is resolved where the user typed the command and its
    weights' headers are checked here; a name (`demo`) is left for the group."""
    path = Path(model).expanduser()
    if model == "demo" or not (path.exists() or model.startswith((".", "/", "~"))):
        return model
    from spill.streamer.plan import load_plan
    from .models import resolve
    folder = resolve(model)
    load_plan(folder)
    return str(folder)


def check_run(*, model, input, output, max_tokens, temperature, resume, new) -> tuple[dict, Job | None]:
    """The submit request's arguments, and the finished job this same command already ran (or None)."""
    check_flags(max_tokens=max_tokens, temperature=temperature)
    args = {"model": None, "input": None, "output": None, "max_tokens": max_tokens,
            "temperature": temperature, "resume": resume, "new": new}
    if resume:
        Job.open(resume).check_input()
        return args, None
    args["model"] = local_model(model)
    inp = Path(input).resolve()
    out = Path(output).resolve() if output else None
    args["input"], args["output"] = str(inp), str(out) if out else None
    read_batch(inp)                      # the whole file's problems: missing, empty, not JSONL, duplicate ids
    if new:
        if out is not None:
            check_output_free(out)
        return args, None
    job = Job.find(inp, out, args["model"])
    if job is not None:
        job.check_input()
        return args, None
    finished = Job.find(inp, out, args["model"], finished=True)
    if finished is None and out is not None:
        check_output_free(out)
    return args, finished
