"""Who may drive the group (issue 8, finding 4): loopback unless allowed, a token on tcp."""

import os

import pytest

from spill.coordinator import control
from spill.errors import SpillError


@pytest.mark.parametrize("address", ["ipc:///tmp/x/control.sock", "tcp://127.0.0.1:5557", "tcp://localhost:5557",
                                     "tcp://[::1]:5557", "tcp://127.0.0.2:9"])
def test_loopback_and_ipc_are_allowed(address):
    control.check_address(address)


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:5558", "tcp://*:5558", "tcp://10.1.2.3:5558", "tcp://example.org:1"])
def test_an_address_other_hosts_reach_needs_the_flag(address):
    with pytest.raises(SpillError) as err:
        control.check_address(address)
    assert str(err.value).startswith(f"--listen {address} lets other machines drive this group; use "
                                     "tcp://127.0.0.1:PORT, or pass --allow-remote to `spill up`")
    control.check_address(address, allow_remote=True)


def test_a_tcp_socket_makes_a_private_token_the_client_reads(monkeypatch, tmp_path):
    import zmq
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    monkeypatch.delenv("SPILL_TOKEN", raising=False)
    (tmp_path / "run").mkdir()
    sock, token = control.open_control(zmq.Context.instance(), "tcp://127.0.0.1:*")
    try:
        assert len(token) >= 32 and oct(os.stat(control.token_file()).st_mode & 0o777) == "0o600"
        assert control.client_token("tcp://127.0.0.1:5557") == token
        assert control.client_token("ipc:///x") == ""
        assert control.authorized(token, token) and not control.authorized(token, "") and control.authorized("", "")
    finally:
        sock.close()


class Group:
    """A group that answers every request it is handed with `reply`."""
    def __init__(self, reply):
        self.reply, self.asked = reply, []

    def handle(self, req):
        self.asked.append(req)
        return self.reply


def _answer(group, frame: bytes):
    import structlog
    from spill import messages as m
    return m.decode(control.reply_frame(group, frame, "", "ipc://x", structlog.get_logger()))


def test_a_request_with_a_field_out_of_range_is_refused_naming_it_and_reaches_no_handler():
    import msgpack
    from spill import messages as m
    group = Group(m.Pong(1))
    frame = bytes([m.Kind.SUBMIT_JOB]) + msgpack.packb({"model": "demo", "input": "in.jsonl", "max_tokens": -1})
    assert _answer(group, frame) == m.Refused("not a spill request (SubmitJob.max_tokens: expected an int from 1 to "
                                              "2147483647 or None, found -1)")
    assert _answer(group, bytes([99]) + msgpack.packb({})) == m.Refused("not a spill request (unknown message kind 63)")
    assert group.asked == []


def test_a_reply_the_wire_cannot_carry_becomes_a_refusal_not_the_coordinators_end():
    from spill import messages as m
    group = Group(m.JobStatus("j", memory={"working_set": object()}))
    reply = _answer(group, m.encode(m.Status("j")))
    assert isinstance(reply, m.Refused) and reply.error.startswith("the group could not encode its JobStatus (TypeError")
    assert group.asked == [m.Status("j")]


def test_spill_ups_flags_reach_the_group_as_its_arguments_not_through_the_environment(monkeypatch):
    import json
    from typer.testing import CliRunner
    from spill.coordinator import client, run
    from spill.coordinator.cli import app
    seen = {}
    monkeypatch.setattr(run, "group_up", lambda **kw: seen.update(kw) or "up")
    before = dict(os.environ)
    result = CliRunner().invoke(app, ["up", "--allow-remote", "--metrics-port", "0", "--metrics-host", "0.0.0.0"])
    assert result.exit_code == 0, result.output
    assert seen["group_args"] == {"allow_remote": True, "metrics_host": "0.0.0.0", "metrics_port": 0}
    assert dict(os.environ) == before

    class Started(Exception):
        pass

    def popen(argv, **_):
        seen["daemon"] = json.loads(argv[-1])
        raise Started
    monkeypatch.setattr(client.subprocess, "Popen", popen)
    monkeypatch.setattr(client.rundir, "rotate_logs", lambda: None)
    with pytest.raises(Started):   # a tcp address other hosts reach, allowed by the argument alone
        client.start_group(client.endpoints("tcp://0.0.0.0:5999"), embedded=False, group_args=seen["group_args"])
    assert seen["daemon"]["group_args"] == seen["group_args"]
