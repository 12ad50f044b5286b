"""The tokenizer actor: SUBMIT -> TOKENIZED (or ERROR); TOKENS -> DONE, STOP and PROGRESS."""

import threading

import numpy as np

from spill import messages as m
from spill.actor import Fault, inbox, run_actor
from spill.wire import Mailbox

from .core import TokenizerCore


def _warm() -> None:
    """mlx-lm's tokenizer loader imported beside the loop (with transformers, ~2 s on 2 cores), not when the first
    job's RESET comes: a later import of it waits for this one (Python's module lock)."""
    threading.Thread(target=lambda: __import__("mlx_lm.utils"), name="warm-imports", daemon=True).start()


def run_tokenizer_process(endpoints, args, log) -> None:
    _warm()
    box = Mailbox(endpoints, "tokenizer", sends_to=("admission", "coordinator"))
    fault = Fault("tokenizer")
    core, model, job = None, "", ""
    for batch in inbox(box, "tokenizer", log):
        for msg in batch:
            if isinstance(msg, m.Reset):
                job = msg.job   # results are stamped with it: the coordinator drops another job's
                if msg.model and msg.model != model:
                    try:
                        core, model = TokenizerCore(msg.model), msg.model
                    except Exception as err:  # no usable tokenizer: the job fails, not this process
                        core, model = None, ""
                        why = str(err).splitlines()[0] if str(err) else type(err).__name__
                        box.send("coordinator", m.Error(msg.epoch, [m.MODEL_ROW], ["model_error"],
                                                        [f"{msg.model}: the tokenizer could not load ({why})"], msg.job))
                elif core is not None:
                    core.clear()
            elif core is None:
                continue
            elif isinstance(msg, m.Submit):
                _submit(box, core, msg, job)
                fault.tick("submit")
            elif isinstance(msg, m.Tokens):
                _tokens(box, core, msg, job, log)
                fault.tick("tokens")
            elif isinstance(msg, m.Ended):
                core.forget(msg.rows)
    box.close()


def _submit(box, core: TokenizerCore, msg: m.Submit, job: str) -> None:
    ok, seqs, bad, why = [], [], [], []
    for row, request, (ids, reason) in zip(msg.rows, msg.requests, core.tokenize_many(msg.rows, msg.requests)):
        if ids is None:
            bad.append(row)
            why.append(reason)
        else:
            ok.append((row, request))
            seqs.append(ids)
    if bad:
        box.send("coordinator", m.Error(msg.epoch, bad, ["context_length_exceeded"] * len(bad), why, job))
    if ok:
        tokens, lengths = m.pack_tokens(seqs)
        box.send("admission", m.Tokenized(msg.epoch, [r for r, _ in ok], tokens, lengths, [r.max_tokens for _, r in ok],
                                          m.Sampling.of(r.sampling for _, r in ok), core.eos))


def _tokens(box, core: TokenizerCore, msg: m.Tokens, job: str, log) -> None:
    stops, done, lost = [], [], []
    for row, token, finish, at in zip(msg.rows, np.frombuffer(msg.tokens, np.int32).tolist(), msg.finish, msg.positions):
        if finish not in ("preempted", "refused") and core.lost(row, at):
            lost.append(row)
            continue
        hit, reason = core.add(row, token, finish)
        if hit:
            stops.append(row)
        if reason:
            done.append(core.finish(row, reason))
            done[-1] = (row, *done[-1])
    if lost:
        log.warning("tokens lost on the way; the rows wait to be submitted again", rows=lost)
    if stops:
        box.send("admission", m.Stop(msg.epoch, stops))   # the scheduler ends them; its next plan frees their slots
    if done:
        rows, texts, finish, prompt, completion = map(list, zip(*done))
        box.send("coordinator", m.Done(msg.epoch, rows, texts, finish, prompt, completion, job))
    running = [r for r in dict.fromkeys(msg.rows) if r in core.live]   # a row that accepted drafts: once
    if running:
        counts, tails = core.tails(running)
        box.send("coordinator", m.Progress(msg.epoch, running, counts, tails, job))


if __name__ == "__main__":
    run_actor("tokenizer", run_tokenizer_process)
