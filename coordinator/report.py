"""Tables the CLI prints."""

from rich.console import Console
from rich.table import Table


def print_check(results, tolerance: float, console: Console | None = None) -> bool:
    """Per-row table of `spill check`, then `N/N identical` or what differed. True when all pass."""
    console = console or Console()
    table = Table("row", "prompt tok", "joined at pass", "tokens", "identical", "max |Δ logit|")
    for r in results:
        table.add_row(r.id, str(r.prompt_tokens), str(r.joined_pass), str(len(r.got)),
                      "yes" if r.identical else "NO", f"{r.max_logit_diff:.2e}")
    console.print(table)
    bad = [r for r in results if not r.identical or r.max_logit_diff > tolerance]
    for r in bad:
        k = r.first_difference()
        where = f"token {k}: resident {r.expected[k:k + 4]} streamed {r.got[k:k + 4]}" if k is not None else "tokens equal"
        console.print(f"row {r.id} differs: {where}; max logit difference {r.max_logit_diff:.2e} (tolerance {tolerance:.0e})")
    worst = max((r.max_logit_diff for r in results), default=0.0)
    console.print(f"max logit difference {worst:.2e} (tolerance {tolerance:.0e})")
    print(f"{len(results) - len(bad)}/{len(results)} identical")
    return not bad
