"""The `spill` command line."""

from pathlib import Path

import typer

from spill.errors import GroupDead, SpillError

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  help="spill: batch inference for models larger than memory.")


MODEL_HELP = ("A local model folder, a tag (`spill models` lists them), a Hugging Face id org/name[@revision], "
              "or 'demo' (a small generated model).")
MEMORY_HELP = "Plan for this much memory (e.g. 48GB, 1.5GiB) instead of the detected working set."
KV_BITS_HELP = "Store the decode rows' K and V quantized to 8 or 4 bits (MLX's affine format): more rows a pass."
KV_GROUP_HELP = "Values sharing one scale and bias in quantized KV: 32, 64 or 128 (must divide the head dimension)."
SPECULATE_HELP = ("Drafts a decode row carries each pass, from its own text (prompt lookup), verified in the same "
                  "read: auto (the default: as many as the pass's read hides and the row's acceptance pays for), "
                  "off, or K, 1 to 16. Greedy rows give the same text; sampled rows the same distribution, "
                  "each row's text fixed by its seed.")
CHECK_SPECULATE_HELP = ("Free-running rows carry up to K drafts a pass (prompt lookup), verified in the pass; in "
                        "float32 their greedy text must equal mlx-lm's (with --kv-bits, over its quantized cache): "
                        "off (the default) or K, 1 to 16.")
DRAFT_HELP = ("A small model with the model's tokenizer (a folder or a tag, as MODEL) that proposes the drafts, "
              "resident beside the streamed one, in place of prompt lookup; with --speculate auto or K.")
RANKS_HELP = ("Run the model as a pipeline of N ranks on this machine (loopback), each holding its share of the "
              "layers; 1 (the default) is one process. Under mlx.launch, leave it out: `spill up` on every rank "
              "makes rank 0 the group and the others its stages.")
MICRO_HELP = ("Micro-batches a pass of a pipeline group (--ranks above 1) whose stages hold their layers: each stage "
              "computes one while the next stage takes the one before; 0 (the default) is one a rank, 1 a stage at "
              "a time. A group of one rank ignores it.")
FRACTION_HELP = "Share of the working set that live allocation aims at (default 0.78; 0.90 of a CUDA GPU's memory)."


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version
        typer.echo(f"spill {version('streamweights')}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """spill: batch inference for models larger than memory."""


def _fail(err: Exception, code: int = 2) -> None:
    typer.echo(f"spill: {err}", err=True)
    raise typer.Exit(code)


@app.command("make-model")
def make_model_cmd(
    out: Path = typer.Argument(..., help="Folder to write (must not exist or be empty)."),
    family: str = typer.Option("llama", help="Model family: llama, qwen2, mistral, qwen3, phi3, gemma2, gemma3_text."),
    size: str = typer.Option("tiny", help="Size preset: tiny, small, tall, lean, lean45, 1b, 3b or deep."),
    seed: int = typer.Option(0, help="Random seed; the same seed gives the same bytes."),
    dtype: str = typer.Option("bfloat16", help="Storage dtype: bfloat16, float16 or float32."),
    shard_size: str = typer.Option("", help="Shard the weights into files of at most this size (e.g. 500MB); empty: one file."),
    bits: int = typer.Option(None, help="Quantize (MLX, mlx-community layout) to 4 or 8 bits."),
    group_size: int = typer.Option(64, help="Quantization group size: 32, 64 or 128."),
) -> None:
    """Write a Hugging Face-layout model folder with random weights of the family's real shapes."""
    from spill.factory import make_model
    try:
        path = make_model(out, family=family, size=size, seed=seed, dtype=dtype, shard_size=shard_size or None,
                          bits=bits, group_size=group_size)
    except SpillError as err:
        _fail(err)
    typer.echo(str(path))


@app.command("import-gguf")
def import_gguf_cmd(
    file: Path = typer.Argument(..., help="A llama GGUF file (llama.cpp's format), quantized or not."),
    out: Path = typer.Argument(..., help="Folder to write (must not exist or be empty)."),
    dtype: str = typer.Option("bfloat16", help="Storage dtype of the dequantized weights: bfloat16, float16 or float32."),
) -> None:
    """Write a Hugging Face-layout model folder from a GGUF file (needs `pip install 'streamweights[gguf]'`)."""
    from spill.coordinator.import_gguf import import_gguf
    try:
        path = import_gguf(file, out, dtype=dtype)
    except SpillError as err:
        _fail(err)
    typer.echo(str(path))


@app.command("check")
def check_cmd(
    model: str = typer.Argument(..., help=MODEL_HELP),
    rows: int = typer.Option(20, help="How many prompts to run."),
    max_tokens: int = typer.Option(16, help="Tokens to generate per row."),
    prefill_chunk: int = typer.Option(128, help="Prompt positions a prefill group computes per pass."),
    dtype: str = typer.Option(None, help="Compute dtype of both sides: bfloat16, float16 or float32 "
                                         "(default: float32 on the CPU, the stored dtype on a GPU)."),
    tolerance: float = typer.Option(None, help="Largest logit difference accepted (default: derived from the dtype)."),
    kv_bits: int = typer.Option(None, help=KV_BITS_HELP),
    kv_group_size: int = typer.Option(None, help=KV_GROUP_HELP + " Default 64."),
    speculate: str = typer.Option(None, help=CHECK_SPECULATE_HELP),
    draft: str = typer.Option(None, help=DRAFT_HELP),
) -> None:
    """Run prompts streamed and resident (mlx-lm), greedy: teacher-forced logits within a tolerance of
    the dtype, and free-running identity."""
    from spill.coordinator.preflight import model_folder
    from spill.coordinator.report import print_check
    from spill.coordinator.submit import draft_refusal, vocabulary_refusal
    from spill.streamer.check import run_check
    try:
        folder, drafts = model_folder(model), model_folder(draft) if draft else None
        spec = speculate_arg(speculate) or 0
        if why := draft and (draft_refusal(draft, spec) or vocabulary_refusal(folder, drafts, draft)):
            raise SpillError(why)
        report = run_check(folder, n=rows, max_tokens=max_tokens, prefill_chunk=prefill_chunk, dtype=dtype,
                           tolerance=tolerance, **kv_args(kv_bits, kv_group_size), speculate=spec, draft=drafts)
    except SpillError as err:
        _fail(err)
    if not print_check(report):
        raise typer.Exit(1)


@app.command("models")
def models_cmd() -> None:
    """The curated tags (models.yaml) and the models cached on this machine."""
    from spill.coordinator.report import print_models
    print_models()


@app.command("pull")
def pull_cmd(model: str = typer.Argument(..., help="A tag, a Hugging Face id org/name[@revision].")) -> None:
    """Download a model (only the files spill reads) without running it; prints its folder."""
    from spill.coordinator.models import resolve, warning
    try:
        folder = resolve(model)
    except SpillError as err:
        _fail(err)
    if note := warning(folder):
        typer.echo(f"warning: {note}", err=True)
    typer.echo(str(folder))


@app.command("run")
def run_cmd(
    model: str = typer.Argument(None, help=MODEL_HELP),
    input: Path = typer.Argument(None, help="JSONL of requests (OpenAI Batch or {custom_id, prompt|messages})."),
    output: Path = typer.Option(None, "-o", "--output", help="Where results go (default: the job folder)."),
    max_tokens: int = typer.Option(256, help="Tokens per row when the row does not say."),
    temperature: float = typer.Option(0.0, help="Sampling temperature when the row does not say; 0 is greedy."),
    resume: str = typer.Option(None, help="Continue this job id."),
    new: bool = typer.Option(False, "--new", help="Start a new job even if this command already ran."),
    quiet: bool = typer.Option(False, "--quiet", help="Terminal: only the progress line. Piped: only the summary."),
    every: float = typer.Option(10.0, "--every", help="Piped output: seconds between progress lines."),
    listen: str = typer.Option(None, help="Control address of the group (default: the running group's)."),
    stream: bool = typer.Option(False, "--stream", help="Stream the weights every pass even if the model fits resident (SPILL_STREAM=1)."),
    memory: str = typer.Option(None, help=MEMORY_HELP),
    budget_fraction: float = typer.Option(None, help=FRACTION_HELP),
    kv_bits: int = typer.Option(None, help=KV_BITS_HELP),
    kv_group_size: int = typer.Option(None, help=KV_GROUP_HELP + " Default 64."),
    speculate: str = typer.Option(None, help=SPECULATE_HELP),
    draft: str = typer.Option(None, help=DRAFT_HELP),
    ranks: int = typer.Option(None, "--ranks", help=RANKS_HELP + " Where a group runs, it must say the same."),
    micro_batches: int = typer.Option(None, "--micro-batches", help=MICRO_HELP + " Where a group runs, it must say "
                                      "the same."),
) -> None:
    """Run a JSONL batch: on the running group (`spill up`), or on one started for this job.
    Exit code: 0 every row succeeded, 3 some rows failed, 130 interrupted, 1 the job failed, 2 a usage error."""
    from spill.coordinator.run import run_job
    from spill.memory import memory_args
    if _launched():
        _fail(SpillError("mlx.launch starts `spill up` on every rank, not `spill run`: run `mlx.launch ... -- spill up`, "
                         "then `spill run` on rank 0's host"))
    if resume is None and (model is None or input is None):
        _fail(SpillError("give MODEL and INPUT.jsonl, or --resume JOB_ID"))
    if resume is not None and (model is not None or input is not None):
        _fail(SpillError(f"--resume {resume} continues that job with its own model and input; give either "
                         "MODEL and INPUT.jsonl, or --resume JOB_ID, not both"))
    if not every > 0:
        _fail(SpillError(f"--every must be a number of seconds above 0, found {every:g}"))
    try:
        code = run_job(model=model, input=input, output=output, max_tokens=max_tokens, temperature=temperature,
                       resume=resume, new=new, quiet=quiet, listen=listen, every=every, stream=stream,
                       memory=memory_args(memory, budget_fraction), kv=kv_args(kv_bits, kv_group_size),
                       speculate=speculate_arg(speculate), draft=draft, ranks=ranks_arg(ranks, speculate, draft),
                       micro_batches=micro_batches_arg(micro_batches))
    except GroupDead as err:   # not a usage error: the group stopped under the job
        _fail(err, 1)
    except SpillError as err:
        _fail(err)
    raise typer.Exit(code)


@app.command("up")
def up_cmd(
    model: str = typer.Option(None, help="Prepare this model (a folder or 'demo') while starting."),
    foreground: bool = typer.Option(False, "--foreground", help="Stay attached; Ctrl-C stops the group."),
    listen: str = typer.Option(None, help="Control address for clients: a port (5557) or tcp://127.0.0.1:5557."),
    allow_remote: bool = typer.Option(False, "--allow-remote", help="Let --listen take an address other hosts reach (a token is required)."),
    metrics_port: int = typer.Option(None, help="Port of the Prometheus endpoint (default 9464; 0 serves none)."),
    metrics_host: str = typer.Option(None, help="Address of the endpoint (default 127.0.0.1, this machine only)."),
    memory: str = typer.Option(None, help=MEMORY_HELP),
    budget_fraction: float = typer.Option(None, help=FRACTION_HELP),
    kv_bits: int = typer.Option(None, help=KV_BITS_HELP + " The group's default for jobs that do not say."),
    kv_group_size: int = typer.Option(None, help=KV_GROUP_HELP + " Default 64."),
    speculate: str = typer.Option(None, help=SPECULATE_HELP + " The group's default for jobs that do not say."),
    draft: str = typer.Option(None, help=DRAFT_HELP + " The group's default for jobs that do not say."),
    ranks: int = typer.Option(None, "--ranks", help=RANKS_HELP),
    micro_batches: int = typer.Option(None, "--micro-batches", help=MICRO_HELP),
    hostfile: Path = typer.Option(None, "--hostfile", help="MLX's hostfile: mlx.launch starts `spill up` on every "
                                  "host, this one (its first) rank 0; see docs/pipeline.md."),
) -> None:
    """Start the actor group and return (it keeps running until `spill down`). Under mlx.launch, ranks past 0 each
    run a stage of rank 0's group instead (and return when it lets them go)."""
    import os
    if os.environ.get("MLX_RANK", "0") != "0":   # mlx.launch's rank past 0: a stage following rank 0's streamer
        from spill.platform import reexec_with_preload
        from spill.stages.serve import main as serve
        reexec_with_preload()   # its own --memory and --budget-fraction: what it tells rank 0 its budget is
        raise typer.Exit(serve([*(["--memory", memory] if memory else []),
                                *(["--budget-fraction", str(budget_fraction)] if budget_fraction is not None else [])]))
    from spill.coordinator.preflight import local_model
    from spill.coordinator.run import group_up
    from spill.coordinator.telemetry import metrics_args
    from spill.memory import memory_args
    try:
        settings = {**metrics_args(metrics_host, metrics_port), **({"allow_remote": True} if allow_remote else {})}
        n = ranks_arg(ranks, speculate, draft)
        if hostfile is not None:   # the same `spill up`, on every host through mlx.launch
            from spill.stages.hosts import launch
            typer.echo(launch(hostfile, n))
            return
        if n and n > 1 and "MLX_RANK" in os.environ:
            raise SpillError(f"mlx.launch made this `spill up` rank 0 of its ranks; leave --ranks {n} out")
        typer.echo(group_up(model=model, foreground=foreground, listen=listen,
                            memory={**memory_args(memory, budget_fraction), **kv_args(kv_bits, kv_group_size),
                                    **({} if (k := speculate_arg(speculate)) is None else {"speculate": k}),
                                    **({"draft": local_model(draft)} if draft else {}),
                                    **({"ranks": n} if n and n > 1 else {}),
                                    **({} if (mb := micro_batches_arg(micro_batches)) is None else {"micro_batches": mb})},
                            group_args=settings))
    except SpillError as err:
        _fail(err)


@app.command("down")
def down_cmd(listen: str = typer.Option(None, help="Control address of the group (default: the running group's).")) -> None:
    """Stop the running group; its running and queued jobs are interrupted (resumable)."""
    from spill.coordinator.run import group_down
    try:
        typer.echo(group_down(listen))
    except SpillError as err:
        _fail(err)


@app.command("cancel")
def cancel_cmd(job: str = typer.Argument(..., help="The job id (`spill status` lists them)."),
               listen: str = typer.Option(None, help="Control address of the group (default: the running group's).")) -> None:
    """Stop a running or queued job; what is written stays, and `spill run --resume JOB` continues it."""
    from spill.coordinator.run import cancel_job
    try:
        typer.echo(cancel_job(job, listen))
    except SpillError as err:
        _fail(err)


@app.command("status")
def status_cmd(job: str = typer.Argument(None, help="A job id (default: the running job)."),
               listen: str = typer.Option(None, help="Control address of the group (default: the running group's).")) -> None:
    """The group's processes, its running job, and the newest jobs with their outputs."""
    from spill.coordinator.run import group_status
    try:
        typer.echo(group_status(job, listen))
    except SpillError as err:
        _fail(err)


@app.command("estimate")
def estimate_cmd(
    model: str = typer.Argument(..., help=MODEL_HELP),
    input: Path = typer.Argument(..., help="JSONL of requests, as `spill run` takes it."),
    memory: str = typer.Option(None, help="Working set to plan for, e.g. 16GB (default: this machine's)."),
    max_tokens: int = typer.Option(256, help="Tokens per row when the row does not say."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object: total_seconds, ideal_seconds, mode, tiers."),
    stream: bool = typer.Option(False, "--stream", help="Price the run streamed even if the model fits resident."),
    budget_fraction: float = typer.Option(None, help=FRACTION_HELP),
    kv_bits: int = typer.Option(None, help=KV_BITS_HELP),
    kv_group_size: int = typer.Option(None, help=KV_GROUP_HELP + " Default 64."),
    speculate: str = typer.Option(None, help=SPECULATE_HELP),
    draft: str = typer.Option(None, help=DRAFT_HELP),
) -> None:
    """How long `spill run MODEL INPUT` will take here: the rows tokenized, the schedule simulated pass by pass.
    Exit code: 0 an estimate, 2 none (no row can run as given; the lines say why) or a usage error."""
    import json
    from spill.coordinator.estimate import estimate_file
    from spill.coordinator.estimate_text import format_estimate
    from spill.memory import memory_args
    from spill.typed import AUTO_DRAFTS
    from spill.coordinator.preflight import local_model
    from spill.coordinator.submit import draft_refusal
    try:
        memory_args(memory, budget_fraction)   # checked as `spill run` checks them
        kv = kv_args(kv_bits, kv_group_size)
        drafts = AUTO_DRAFTS if (k := speculate_arg(speculate)) is None else k
        if why := draft_refusal(draft, drafts):
            raise SpillError(why)
        est, cal, advice = estimate_file(model, input, max_tokens=max_tokens, memory=memory, stream=stream,
                                         fraction=budget_fraction, kv=(kv_bits, kv["kv_group_size"]) if kv_bits else None,
                                         speculate=drafts, draft=local_model(draft) if draft else None)
    except SpillError as err:
        _fail(err)
    typer.echo(json.dumps({**est.to_dict(), "advice": advice.line, "calibration": cal}) if as_json
               else format_estimate(est, cal, advice))
    if not est.passes:   # "estimate: none" or "nothing to run": what `spill run` would refuse or fail
        raise typer.Exit(2)


@app.command("report")
def report_cmd(job: str = typer.Argument(..., help="A job id (`spill status` lists them)."),
               output: Path = typer.Option(None, "-o", "--output", help="Image to write: .png, .svg or .pdf "
                                                             "(default: report.png in the job folder).")) -> None:
    """Plot a job's passes: pass time against the roofline, memory, running rows, rows done against the estimate."""
    from spill.coordinator.plot import report_job
    try:
        typer.echo(str(report_job(job, output)))
    except SpillError as err:
        _fail(err)


def kv_args(bits: int | None, group_size: int | None) -> dict:
    """--kv-bits and --kv-group-size checked (the model's head dimension is checked where it is read)."""
    from spill.streamer.shares import kv_refusal
    if group_size is not None and bits is None:
        raise SpillError(f"--kv-group-size {group_size} sets quantized KV's groups; add --kv-bits 8 or 4, "
                         "or leave it out")
    if why := kv_refusal(bits, group_size or 64):
        raise SpillError(why)
    return {"kv_bits": bits, "kv_group_size": group_size or 64}


def speculate_arg(value: str | None) -> int | None:
    """--speculate off|auto|K -> K (0: off; AUTO_DRAFTS: auto); None where not given."""
    from spill.typed import AUTO_DRAFTS, MAX_DRAFTS
    if value is None:
        return None
    if value.strip().lower() in ("off", "auto"):
        return 0 if value.strip().lower() == "off" else AUTO_DRAFTS
    if not value.strip().isdigit() or not 1 <= int(value) <= MAX_DRAFTS:
        raise SpillError(f"--speculate takes off, auto or a number of drafts from 1 to {MAX_DRAFTS}, found {value!r}")
    return int(value)


def _launched() -> bool:
    """This command is one rank of several that mlx.launch started (MLX_RANK, MLX_HOSTFILE)."""
    import os
    from spill.coordinator.ring import launched_hosts
    return os.environ.get("MLX_RANK", "0") != "0" or bool(launched_hosts())


def ranks_arg(ranks: int | None, speculate: str | None, draft: str | None) -> int | None:
    """--ranks checked: at least 1, and no drafts on a pipeline (its stages verify none yet)."""
    if ranks is None:
        return None
    if ranks < 1:
        raise SpillError(f"--ranks takes the number of ranks of the pipeline, 1 or more, found {ranks}")
    if ranks > 1 and (draft or (speculate_arg(speculate) or 0) > 0):
        raise SpillError(f"drafts are not verified across the ranks of a group yet; with --ranks {ranks} leave "
                         "--speculate (or set it to off) and --draft out")
    return ranks


def micro_batches_arg(m: int | None) -> int | None:
    """--micro-batches checked: 0 (one a rank) or more."""
    if m is not None and m < 0:
        raise SpillError(f"--micro-batches takes 0 (one a rank) or the micro-batches of a pass, 1 or more, found {m}")
    return m


def main() -> None:
    import sys
    from spill.platform import without_torch
    without_torch()
    if sys.argv[1:2] not in (["run"], ["status"], ["up"], ["down"], ["cancel"]):   # these run no MLX here:
        from spill.platform import reexec_with_preload                           # no second start
        reexec_with_preload()
    app(prog_name="spill")


if __name__ == "__main__":
    main()
