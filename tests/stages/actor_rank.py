"""A rank of a pipeline group whose stage 0 is the streamer actor, driven without sockets: rank 0 takes the
RESET and PLAN frames in MESSAGES (a msgpack list) as the actor's loop would and writes each pass's tokens (or
a reset's error) to OUT; ranks 1..N-1 are `python -m spill.stages.serve`'s."""

import json
import os
import sys
from pathlib import Path

import msgpack
import numpy as np

from spill import messages as m
from spill.errors import SpillError
from spill.stages import serve
from spill.stages.relay import group_relay
from spill.stages.ranked import tell
from spill.streamer.process import StreamerActor


def run(actor: StreamerActor, frames: list[bytes]) -> list[dict]:
    """Each message's outcome: a pass's tokens, or a reset's error (the actor's loop reports it and goes on)."""
    out = []
    for msg in map(m.decode, frames):
        if isinstance(msg, m.Reset):
            try:
                actor.reset(msg)
            except SpillError as err:
                actor.engine, actor.model = None, ""
                out.append({"error": str(err)})
        elif actor.engine is not None:
            tokens, _, refused = actor.run(msg)
            out.append({"rows": tokens.rows, "tokens": np.frombuffer(tokens.tokens, np.int32).tolist(),
                        "finish": tokens.finish, "positions": tokens.positions, "refused": [r for r, _ in refused]})
    return out


def main(messages: str, out: str) -> int:
    if int(os.environ.get("MLX_RANK", "0")) > 0:
        return serve.main([])
    relay = group_relay()
    actor = StreamerActor(prefill_chunk=16, relay=relay)
    try:
        Path(out).write_text(json.dumps(run(actor, msgpack.unpackb(Path(messages).read_bytes()))))
    finally:
        if actor.engine is not None:
            actor.engine.close()
        tell(relay, "exit")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
