"""`spill report JOB`: a PNG of a finished or running job from its pass history.

    pass time   each pass's seconds against its roofline max(IO, compute): IO = bytes streamed /
                the calibrated bandwidth, compute = the layer math the streamer timed
    memory      live (active) and peak memory, and the budget and working set where passes report them
    rows        rows running (decoding) in each pass, prefill tokens on the right axis
    progress    rows done against time, and the pre-run estimate where the job stored one
"""

from pathlib import Path

from spill.errors import SpillError
from spill.files import replaced

from . import history
from .jobstore import Job, check_output_path

GB = 1e9


def report_job(job_id: str, out: Path | None = None) -> Path:
    """`spill report`: the job's PNG, its roofline from this machine's calibration of its model."""
    job = Job.open(job_id)
    bandwidth = None
    try:
        from spill.admission.calibration import stored_calibration
        from .models import resolve
        cal = stored_calibration(resolve(job.meta["model"]))
        bandwidth = cal.model.bandwidth if cal else None
    except (SpillError, OSError, KeyError):   # a model moved or removed since: plot without the roofline
        pass
    return write_report(job, out, bandwidth)


def write_report(job: Job, out: Path | None = None, bandwidth: float | None = None) -> Path:
    """Draw the job's passes into `out` (default: report.png in the job's folder)."""
    passes = history.read(job.dir)
    if not passes:
        raise SpillError(f"job {job.id} has no passes recorded yet; run it (`spill run`) and report again")
    out = Path(out) if out else job.dir / "report.png"
    check_output_path(out, "report.png")
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise SpillError(f"-o {out} is not an image name; end it in .png, .svg or .pdf")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = passes[0]["time"] - passes[0]["seconds"]
    minutes = [(p["time"] - t0) / 60 for p in passes]
    fig, ax = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    fig.suptitle(f"job {job.id}: {job.meta.get('model', '')}, {len(passes)} passes")

    # 1. pass time against the roofline
    ax[0].plot(minutes, [p["seconds"] for p in passes], ".-", label="pass")
    ax[0].plot(minutes, [p["compute_s"] for p in passes], ":", label="compute (streamer)")
    if bandwidth:
        io = [p["bytes_streamed"] / bandwidth for p in passes]
        ax[0].plot(minutes, io, "--", label=f"IO ({bandwidth / GB:.2f} GB/s)")
        ax[0].plot(minutes, [max(i, p["compute_s"]) for i, p in zip(io, passes)], "-", alpha=0.6,
                   label="roofline max(IO, compute)")
    ax[0].set_ylabel("seconds")
    ax[0].set_title("pass time" + ("" if bandwidth else " (no calibration here: roofline not drawn)"))

    # 2. memory
    ax[1].plot(minutes, [p["active_memory"] / GB for p in passes], label="live (active)")
    ax[1].plot(minutes, [p["peak_memory"] / GB for p in passes], alpha=0.6, label="peak")
    for key in sorted({k for p in passes for k in p if "budget" in k or "working_set" in k}):
        values = [p.get(key) for p in passes]
        if all(isinstance(v, (int, float)) for v in values) and max(values) > 1e6:
            ax[1].plot(minutes, [v / GB for v in values], "--", label=key.replace("_", " "))
    ax[1].set_ylabel("GB")
    ax[1].set_title("memory")

    # 3. rows in each pass
    ax[2].step(minutes, [p["decode_rows"] for p in passes], where="post", label="decoding rows")
    ax[2].set_ylabel("rows")
    right = ax[2].twinx()
    right.plot(minutes, [p["prefill_tokens"] for p in passes], ".", color="tab:orange", label="prefill tokens")
    right.set_ylabel("prefill tokens")
    right.legend(loc="upper right")
    ax[2].set_title("running rows")

    # 4. rows done against the estimate
    ax[3].plot(minutes, [p["done"] for p in passes], label="rows done")
    est = job.meta.get("estimate") or {}
    if est.get("timeline"):
        ax[3].plot([t / 60 for t, _ in est["timeline"]], [n for _, n in est["timeline"]], "--",
                   label=f"estimate ({est.get('total_seconds', 0) / 60:.1f} min)")
    ax[3].set_ylabel("rows")
    ax[3].set_xlabel("minutes since the first pass started")
    ax[3].set_title("progress")

    for a in (ax[0], ax[1], ax[2], ax[3]):
        a.grid(alpha=0.3)
        a.legend(loc="upper left")
    fig.tight_layout()
    try:
        with replaced(out) as part:   # never a half-drawn file at `out`
            fig.savefig(part, dpi=90, format=out.suffix[1:].lower())
    except OSError as err:
        raise SpillError(f"could not write {out} ({err.strerror or err}); choose another -o path") from None
    finally:
        plt.close(fig)
    return out
