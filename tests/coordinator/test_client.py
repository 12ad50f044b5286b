"""One request, one reply: a request cut short (Ctrl-C while it waits) leaves the client usable."""

import signal
import threading

import pytest
import zmq

from spill import messages as m
from spill.coordinator.client import Client
from spill.errors import GroupDead
from spill.wire import Endpoints


def _group(eps: Endpoints, bound: threading.Event, ops: list, first: bool = False, second: bool = True) -> None:
    """A control socket that answers its second request unless told not to (and, with `first`, the first one, late)."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(eps.control)
    bound.set()
    try:
        for answer, done in ((first, 1), (second, 3)):
            if not sock.poll(10_000):
                return
            *envelope, raw = sock.recv_multipart()
            ops.append(m.decode(raw).op)
            if answer:
                sock.send_multipart([*envelope, m.encode(m.Stopped("j", "running", done, 9))])
    finally:
        sock.close()


def test_a_request_interrupted_while_it_waits_leaves_the_client_able_to_send(tmp_path):
    eps, bound, ops = Endpoints.in_dir(tmp_path), threading.Event(), []
    group = threading.Thread(target=_group, args=(eps, bound, ops))
    group.start()
    bound.wait(10)
    client = Client(eps)

    def press(*_):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGALRM, press)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)   # Ctrl-C while `status` waits for its answer
        with pytest.raises(KeyboardInterrupt):
            client.request(m.Status(), timeout_s=5)
        assert client.request(m.Interrupt(), timeout_s=5).done == 3
    finally:
        signal.signal(signal.SIGALRM, previous)
        client.close()
        group.join()
    assert ops == ["status", "interrupt"]


def test_a_late_answer_to_a_timed_out_request_is_not_taken_for_the_next_ones(tmp_path):
    eps, bound, ops = Endpoints.in_dir(tmp_path), threading.Event(), []
    client = Client(eps)
    with pytest.raises(GroupDead):
        client.request(m.Status(), timeout_s=0.2)     # sent before the group is there; answered after the timeout
    group = threading.Thread(target=_group, args=(eps, bound, ops, True))
    group.start()
    try:
        bound.wait(10)
        assert client.request(m.Interrupt(), timeout_s=5).done == 3
    finally:
        client.close()
        group.join()
    assert ops == ["status", "interrupt"]


def test_a_late_answer_to_a_timed_out_request_does_not_hang_the_next_one_past_its_deadline(tmp_path):
    # the stale reply wakes the poll but is dropped by the socket: a blocking recv then waited forever
    eps, bound, ops = Endpoints.in_dir(tmp_path), threading.Event(), []
    client = Client(eps)
    with pytest.raises(GroupDead):
        client.request(m.Ping(), timeout_s=0.2)
    group = threading.Thread(target=_group, args=(eps, bound, ops, True, False))
    group.start()
    try:
        bound.wait(10)
        with pytest.raises(GroupDead, match="did not answer during `submit`"):
            client.request(m.SubmitJob(), timeout_s=2)
    finally:
        client.close()
        group.join()
    assert ops == ["ping", "submit"]
