"""What `spill run` checks before it starts or reaches a group, in a fraction of a second and without
MLX: the flag values, the model folder, the input file, the output path, and whether the same command
already finished. The group checks them again; this is so that a mistake is refused at once."""

from pathlib import Path

from spill.errors import SpillError

from .batch_input import check_params, read_batch
from .jobstore import Job, check_output_free, jobs_dir

# the files a tokenizer loads from, any one set of them (transformers' fast, sentencepiece, BPE, WordPiece)
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))


def check_flags(**values) -> None:
    """--max-tokens and --temperature get the checks and the wording a row's fields get."""
    errs = check_params({k: v for k, v in values.items() if v is not None})
    if errs:
        raise SpillError("; ".join("--" + e.replace("_", "-", e.index(" ")) for e in errs))


def is_path(model: str) -> bool:
    """MODEL names a local folder (rather than `demo`, a tag or a Hugging Face id)."""
    return model != "demo" and (Path(model).expanduser().exists() or model.startswith((".", "/", "~")))


def local_model(model: str) -> str:
    """MODEL as the group should see it: a folder is resolved where the user typed the command and its
    weights' headers and tokenizer files are checked here; a name (`demo`) is left for the group."""
    if not is_path(model):
        return model
    from spill.streamer.plan import load_plan
    from .models import resolve
    folder = resolve(model)
    load_plan(folder)
    check_tokenizer(folder)
    return str(folder)


def model_folder(model: str) -> Path:
    """`spill check`'s MODEL: a folder as given (its checks name the path), else resolved as `spill run` does."""
    if is_path(model):
        return Path(model).expanduser()
    from .models import resolve
    folder = resolve(model)
    check_tokenizer(folder)
    return folder


def check_tokenizer(folder: Path) -> None:
    """One sentence when the folder has none of the files a tokenizer loads from (the job would fail at its start)."""
    if not any(all((folder / name).is_file() for name in names) for names in TOKENIZER_FILES):
        raise SpillError(f"model folder {folder} has no tokenizer: expected tokenizer.json (or tokenizer.model) "
                         "beside config.json; copy the tokenizer files from the model's repository")


def check_run(*, model, input, output, max_tokens, temperature, resume, new) -> tuple[dict, Job | None]:
    """The submit request's arguments, and the finished job this same command already ran (or None)."""
    check_flags(max_tokens=max_tokens, temperature=temperature)
    args = {"model": None, "input": None, "output": None, "max_tokens": max_tokens,
            "temperature": temperature, "resume": resume, "new": new}
    if resume:
        job = Job.open(resume)
        job.check_input()
        return {**args, **job.settings()}, None
    args["model"] = local_model(model)
    inp = Path(input).resolve()
    out = Path(output).resolve() if output else None
    args["input"], args["output"] = str(inp), str(out) if out else None
    requests, bad = read_batch(inp)      # the whole file's problems: missing, empty, not JSONL, duplicate ids
    check_output_room(out, len(requests) + len(bad), max_tokens)
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


def check_output_room(out: Path | None, rows: int, max_tokens: int) -> None:
    """Refused before any job or file is made: a file system without room for the output."""
    from .models import check_room, output_bytes
    check_room(out or jobs_dir(), output_bytes(rows, max_tokens), "the job's output may need",
               "there, or write it elsewhere with -o")
