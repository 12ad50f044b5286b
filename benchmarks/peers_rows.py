"""The rows every peer runs, as spill's input lines and the token ids every other peer is fed.

Two kinds: made-up text of one length for a factory model (random weights: the text only has to round-trip to
the same ids), or the real prompts of benchmarks/data's tiers for a real model, each rendered by the model's chat
template exactly as `spill run` renders it (spill's batch reader, the job's defaults, spill's tokenizer worker).
"""

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
WORDS = ("return value index table stream layer weight batch token memory read write cache pass row "
         "model prompt file disk budget queue worker result error time block shard buffer").split()


def random_rows(folder: Path, rows: int, length: int, new: int) -> tuple[list[dict], list[list[int]]]:
    """`rows` completion lines whose prompts spill's tokenizer turns into exactly `length` ids, and those ids."""
    from spill.tokenizer_worker.core import TokenizerCore
    tok = TokenizerCore(folder).tokenizer
    rng, lines, ids = random.Random(0), [], []
    while len(lines) < rows:
        words = " ".join(rng.choice(WORDS) for _ in range(length))
        cut = tok.encode(f"row {len(lines)}: {words}")[:length]
        text = tok.decode(cut, skip_special_tokens=True)
        if len(cut) == length and tok.encode(text) == cut:   # the text round-trips to the same ids
            lines.append({"custom_id": f"r{len(lines)}", "prompt": text, "max_tokens": new})
            ids.append(cut)
    return lines, ids


def tier_lines(tiers: list[str], rows: int, new: int) -> tuple[list[dict], list[str]]:
    """The tiers' rows, tier after tier, repeated in order where `rows` asks for more (0: each row once), as spill's
    input lines: custom_id r0, r1, ... (row 0 is the one compared across peers), max_tokens `new`, greedy.
    Also each line's source custom_id."""
    found = []
    for tier in tiers:
        path = DATA / f"{tier}.jsonl"
        if not path.is_file():
            have = ", ".join(sorted(p.stem for p in DATA.glob("*.jsonl")))
            raise SystemExit(f"--tier {tier}: there is no {path}; the tiers are {have}")
        found += [json.loads(x) for x in path.read_text().split("\n") if x.strip()]   # not splitlines: U+2028
    picked = [found[i % len(found)] for i in range(rows or len(found))]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": r.get("url", "/v1/chat/completions"),
              "body": {**r["body"], "max_tokens": new, "temperature": 0}} for i, r in enumerate(picked)]
    return lines, [r["custom_id"] for r in picked]


def write_lines(lines: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def token_ids(folder: Path, path: Path) -> list[list[int]]:
    """Each line of spill's input file as spill's tokenizer worker encodes it for a job (so the peers' ids are the
    ids spill runs): read by spill's batch reader, the job's defaults filled in, the chat template rendered."""
    from spill.coordinator.batch_input import read_batch
    from spill.coordinator.jobrun import row_request
    from spill.tokenizer_worker.core import TokenizerCore
    requests, bad = read_batch(path)
    if bad:
        raise SystemExit(f"{path}: spill refuses {len(bad)} of its lines: {bad[0]}")
    core = TokenizerCore(folder)
    return [core.encode(row_request(r, {}, None)) for r in requests]


def eos_ids(folder: Path) -> list[int]:
    """The ids spill stops a row on (mlx-lm's EOS: generation_config.json, config.json and the tokenizer's)."""
    from spill.tokenizer_worker.core import TokenizerCore
    return TokenizerCore(folder).eos


def lengths_line(ids: list[list[int]]) -> str:
    n = sorted(len(x) for x in ids)
    return f"{n[0]}-{n[-1]} tokens (median {n[len(n) // 2]})" if n[0] != n[-1] else f"{n[0]} tokens"
