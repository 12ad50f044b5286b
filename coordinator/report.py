"""Tables the CLI prints."""

from rich.console import Console
from rich.table import Table


def print_check(report, console: Console | None = None) -> bool:
    """Per-row table of `spill check`, what it compared in which dtype, then `passed` or `FAILED`
    with both figures. True when the teacher-forced comparison passes."""
    console = console or Console()
    table = Table("row", "prompt", "joined", "tokens", "identical", "max |Δ logit|", "argmax",
                  caption="prompt tokens, the pass a row joined at; identical: free-running; max |Δ logit| "
                          "and argmax (agree/compared, near-ties left out): teacher-forced")
    for r in report.rows:
        table.add_row(r.id, str(r.prompt_tokens), str(r.joined_pass), str(len(r.got)),
                      "yes" if r.identical else "NO", f"{r.max_logit_diff:.2e}",
                      f"{r.agree}/{len(r.ref_logits) - r.ties}")
    console.print(table)
    from spill.streamer.check import ULPS, ULPS_F32
    from spill.streamer.shares import kv_format
    step = f" + 2^-{report.kv_bits} (a step of the KV format)" if report.kv_bits else ""
    how = (f"({ULPS} x eps {report.eps:.1e} + {ULPS_F32} x float32 eps{step}) x largest |logit| {report.scale:.2f}"
           if report.derived else "given with --tolerance")
    if report.derived and report.spread and report.tolerance == 2 * report.spread:
        how = f"2 x {report.spread:.2e}, mlx-lm's own spread when every weight moves by a rounding step"
    kv = f"; KV {kv_format(report.kv_bits, report.kv_group_size)} against mlx-lm's QuantizedKVCache" if report.kv_bits else ""
    console.print(f"dtype {report.dtype} on the {report.device}{kv}; tolerance {report.tolerance:.2e} ({how})",
                  soft_wrap=True)
    for r in report.failures():
        k = r.first_disagreement
        where = f"argmax differs at step {k}" if k is not None else "argmax agrees"
        if r.forced_steps != len(r.ref_logits):
            where = f"{r.forced_steps} steps streamed, {len(r.ref_logits)} resident"
        elif k is None and r.max_logit_diff <= report.tolerance and r.agree == len(r.ref_logits) - r.ties:
            where = "teacher-forced agrees, free-running with drafts is not identical"
        console.print(f"row {r.id} fails: {where}; max logit difference {r.max_logit_diff:.2e}")
    for r in report.rows:
        k = r.first_difference()
        if k is not None:
            tie = " (a near-tie over quantized KV)" if report.parted_at_near_tie(r) else ""
            console.print(f"row {r.id} free-running diverges at token {k}{tie}: resident {r.expected[k:k + 4]} "
                          f"streamed {r.got[k:k + 4]}")
    if report.speculate:
        gate = "gated" if report.gates_identity else f"not gated in {report.dtype}"
        source = f"from the draft model {report.draft}" if report.draft else "by prompt lookup"
        print(f"drafts: up to {report.speculate} a pass {source} on the free-running rows, {report.drafted} "
              f"proposed, {report.accepted} accepted, {report.tokens_per_pass:.2f} tokens a pass; identity {gate}")
    n = len(report.rows)   # first-token: the streamed first token against mlx_lm.generate run on its own
    print(f"identity {report.identical}/{n}, first-token {report.first_tokens}/{n}")
    verdict = "passed" if report.passed else "FAILED"
    print(f"{verdict}: teacher-forced max |Δ logit| {report.max_logit_diff:.2e} <= {report.tolerance:.2e}: "
          f"{'yes' if report.max_logit_diff <= report.tolerance else 'no'}, argmax {report.agree}/{report.compared} "
          f"({report.ties} near-ties left out); free-running {report.identical}/{len(report.rows)} identical")
    return report.passed


def print_models(console: Console | None = None) -> None:
    """`spill models`: the curated tags, then what is cached locally (size, family, class)."""
    from .models import cached, tags
    console = console or Console()
    if not console.is_terminal:   # piped: whole repo ids and folders, never cut to 80 columns
        console.width = 1000
    here = {c.name: c for c in cached()}
    table = Table("tag", "repo", "revision", "quant", "cached", "note", title="tags (models.yaml)")
    for t in tags().values():
        c = here.get(t.repo)
        table.add_row(t.name, t.repo, t.revision, t.quantization, _gb(c.size) if c else "-", t.note)
    console.print(table)
    table = Table("model", "size", "family", "class", "folder", title="cached on this machine")
    for c in here.values():
        table.add_row(c.name, _gb(c.size), c.family, c.status, str(c.folder))
    console.print(table if here else "no models cached yet: `spill pull MODEL` downloads one")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"
