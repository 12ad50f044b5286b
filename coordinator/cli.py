"""The `spill` command line."""

from pathlib import Path

import typer

from spill.errors import SpillError

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="spill: batch inference for models larger than memory.")


def _fail(err: Exception) -> None:
    typer.echo(f"spill: {err}", err=True)
    raise typer.Exit(2)


@app.command("make-model")
def make_model_cmd(
    out: Path = typer.Argument(..., help="Folder to write (must not exist or be empty)."),
    family: str = typer.Option("llama", help="Model family: llama, qwen2, mistral."),
    size: str = typer.Option("tiny", help="Size preset (tiny, small, 1b, 3b) ."),
    seed: int = typer.Option(0, help="Random seed; the same seed gives the same bytes."),
    dtype: str = typer.Option("bfloat16", help="Storage dtype: bfloat16, float16 or float32."),
    shard_size: str = typer.Option("", help="Shard the weights into files of at most this size (e.g. 500MB); empty: one file."),
) -> None:
    """Write a Hugging Face-layout model folder with random weights of the family's real shapes."""
    from spill.factory import make_model
    try:
        path = make_model(out, family=family, size=size, seed=seed, dtype=dtype, shard_size=shard_size or None)
    except SpillError as err:
        _fail(err)
    typer.echo(str(path))


@app.command("check")
def check_cmd(
    model: Path = typer.Argument(..., help="A model folder (Hugging Face layout)."),
    rows: int = typer.Option(20, help="How many prompts to run."),
    max_tokens: int = typer.Option(16, help="Tokens to generate per row."),
    prefill_chunk: int = typer.Option(128, help="Prompt positions a prefill group computes per pass."),
    tolerance: float = typer.Option(1e-4, help="Largest logit difference accepted."),
) -> None:
    """Run prompts streamed and resident (mlx-lm), greedy, and compare tokens and logits."""
    from spill.coordinator.report import print_check
    from spill.streamer.check import run_check
    try:
        results = run_check(model, n=rows, max_tokens=max_tokens, prefill_chunk=prefill_chunk)
    except SpillError as err:
        _fail(err)
    if not print_check(results, tolerance):
        raise typer.Exit(1)


def main() -> None:
    from spill.platform import reexec_with_preload
    reexec_with_preload()
    app(prog_name="spill")


if __name__ == "__main__":
    main()
