"""The admission actor: queues tokenized rows, admits them to the streamer pass by pass."""

from spill import config
from spill import messages as m
from spill.actor import Fault, inbox, run_actor
from spill.wire import Mailbox

from .calibration import Calibrator
from .policy import FifoPolicy, Waiting


def run_admission_process(endpoints, args, log) -> None:
    box = Mailbox(endpoints, "admission", sends_to=("streamer", "coordinator"))
    policy = FifoPolicy(max_rows=config.max_rows(), prefill_tokens=config.prefill_tokens())
    fault = Fault("admission")
    calibrator = Calibrator(log)
    epoch, eos, in_flight = -1, [], False   # in_flight: an ADMIT the streamer has not reported on
    for batch in inbox(box, "admission", log):
        for msg in batch:
            if isinstance(msg, m.Reset):
                epoch = msg.epoch
                policy.clear()
                calibrator.reset(msg.model)
                in_flight = False
            elif isinstance(msg, m.Tokenized):
                eos = msg.eos
                seqs = m.unpack_tokens(msg.tokens, msg.lengths)
                policy.offer([Waiting(r, n, (s, mt, sp)) for r, n, s, mt, sp in
                              zip(msg.rows, msg.lengths, seqs, msg.max_tokens, msg.sampling)])
                fault.tick("tokenized")
            elif isinstance(msg, m.Pass):
                policy.finished(msg.finished)
                calibrator.passed(msg)
                in_flight = False
                fault.tick("pass")
        if not in_flight and epoch >= 0:
            admitted = policy.admit()
            if admitted:
                box.send("streamer", _admit(epoch, admitted, eos))
                calibrator.admitted([w.row for w in admitted], [w.prompt_tokens for w in admitted])
                in_flight = True
    box.close()


def _admit(epoch: int, rows: list[Waiting], eos: list[int]) -> m.Admit:
    tokens, lengths = m.pack_tokens([w.payload[0] for w in rows])
    return m.Admit(epoch=epoch, rows=[w.row for w in rows], tokens=tokens, lengths=lengths,
                   max_tokens=[w.payload[1] for w in rows], sampling=[w.payload[2] for w in rows], eos=eos)


if __name__ == "__main__":
    run_actor("admission", run_admission_process)
