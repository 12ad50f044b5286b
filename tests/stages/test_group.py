"""A job through `spill run` on a pipeline group of 2 and 3 ranks on loopback, started by `mlx.launch` (its ring
backend, as MLX's own CI runs it) or by `spill up --ranks N` / `spill run --ranks N`: every row's text that of
resident mlx-lm in float32, every custom_id once; a rank killed mid-job, or the streamer crashed, and the job
still finishes so."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import psutil
import pytest
from typer.testing import CliRunner

from spill.coordinator import history
from spill.coordinator.cli import app
from spill.stages.hosts import LAUNCH, status_reply
from spill.streamer.plan import load_plan
from spill.streamer.shares import kv_token_bytes
from tests.coordinator.group_util import llama_job, read_output, seed_home, spill, texts

ring = pytest.mark.skipif(not mx.distributed.is_available("ring"), reason="this MLX build has no ring backend")
SPILL = [sys.executable, "-m", "spill.coordinator.cli"]
MLX_LAUNCH = LAUNCH   # `mlx.launch`, as `spill up --hostfile` runs it


@pytest.fixture(scope="module")
def job12(make_tiny, tmp_path_factory):
    return llama_job(make_tiny, tmp_path_factory, 12, max_tokens=6)


@pytest.fixture
def env(tmp_path, llama_calibration):
    """A data home of the test's own (its group, logs and ring), seeded with the tiny llama's calibration."""
    seed_home(tmp_path / "home", llama_calibration)
    return {**os.environ, "SPILL_HOME": str(tmp_path / "home"), "SPILL_METRICS_PORT": "0"}


def _free_run(n: int) -> int:
    """A port p with p..p+n-1 free on 127.0.0.1 now (mlx.launch gives rank r port p + r)."""
    for _ in range(100):
        base, socks = random.randint(20000, 60000), []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no run of free ports")


def _launch(n: int, env: dict) -> subprocess.Popen:
    """`mlx.launch` running `spill up` on n ranks of 127.0.0.1, once rank 0's group answers with its stages."""
    proc = subprocess.Popen([*MLX_LAUNCH, "--backend", "ring", "--hosts", "127.0.0.1", "-n", str(n),
                             "-p", str(_free_run(n)), "--", *SPILL, "up"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not _stages_now(env):
        assert proc.poll() is None or proc.returncode == 0, proc.communicate()
        assert time.monotonic() < deadline, "the group did not come up"
        time.sleep(0.2)
    return proc


def _stages(env: dict) -> list[str]:
    return [line for line in spill("status", env=env).stdout.splitlines() if line.startswith("stage ")]


def _stages_now(env: dict) -> list[str]:
    """The stage lines `spill status` prints, asked from this process: a poll starts no CLI (a second of CPU each)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPILL_HOME", env["SPILL_HOME"])
        reply = status_reply()
        return list(reply.stages) if reply is not None else []


def _pid(line: str) -> int:
    return int(re.search(r", pid (\d+)", line).group(1))


def _until(ready, proc: subprocess.Popen, timeout: float = 180):
    """ready()'s answer once it is one (polled while `proc` runs)."""
    deadline = time.monotonic() + timeout
    while not (got := ready()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return got


def _run_until(args: list, env: dict, out, lines: int, first=lambda: True) -> tuple[subprocess.Popen, object]:
    """`spill run ...` started, once `first()` answers and then `lines` rows of its output are written; its answer."""
    proc = subprocess.Popen([*SPILL, "run", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    got = _until(first, proc)
    _until(lambda: out.exists() and len(out.read_text().splitlines()) >= lines, proc)
    return proc, got


def _runs_a_job_row_for_row(job12, tmp_path, env: dict, n: int) -> None:
    """On the n ranks mlx.launch started: a job refuses drafts, then writes resident mlx-lm's text; each stage
    says its share of the layers and its own figures, and admission prices the tightest stage's KV."""
    folder, inp, expected = job12
    stages = _stages(env)
    assert [line.split(",")[0] for line in stages] == [f"stage {r}: rank {r} on 127.0.0.1" for r in range(n)]
    refused = spill("run", folder, inp, "--speculate", "2", "-o", tmp_path / "no.jsonl", env=env)
    assert refused.returncode == 2 and refused.stderr.startswith("spill: drafts are not verified across the "
                                                                 f"ranks of a group yet and this group runs {n} ranks")
    run = spill("run", folder, inp, "-o", tmp_path / "out.jsonl", "--quiet", env=env, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"note: drafts are off on a group of {n} ranks: its ranks verify none yet" in run.stdout
    assert texts(read_output(tmp_path / "out.jsonl")) == expected   # every custom_id once, resident mlx-lm's text
    stages = _stages(env)
    layers = [line.split("; ")[0].split(", ")[1] for line in stages]   # the job named the model: each stage's share
    assert layers == {2: ["layers 0-1 of 4", "layers 2-3 of 4"],
                      3: ["layers 0-0 of 4", "layers 1-2 of 4", "layers 3-3 of 4"]}[n]
    for rank, line in enumerate(stages):   # each stage's own figures, from its passes, its budget and link in
        link = rf", link from rank {rank - 1} [\d.e-]+ ms and [\d.]+ \w+/s" if rank else ""
        assert re.search(rf"; working set [\d.]+ \w+ \(weights [\d.]+ \w+, KV [\d.]+ \w+\), budget [\d.]+ \w+{link}; "
                         r"pass [\d.e-]+ s \(compute [\d.e-]+ s, blocked on a neighbour [\d.e-]+ s\), median", line), line
    budget = [json.loads(line) for line in (Path(env["SPILL_HOME"]) / "run" / "logs" / "admission.log")
              .read_text().splitlines() if '"event": "budget"' in line][-1]
    heads, dim = load_plan(folder).kv_heads_and_dim   # the tightest stage holds 2 of the 4 layers' KV of a row
    assert (budget["stages"], budget["kv_per_token"]) == (n, kv_token_bytes(2, heads, dim, 4))


@ring
def test_mlx_launch_ranks_run_a_job_row_for_row_as_one_process(job12, tmp_path, env):
    """3 ranks from `mlx.launch --hosts`; 2 ranks from a hostfile in the `spill up --hostfile` test below."""
    launch = _launch(3, env)
    try:
        _runs_a_job_row_for_row(job12, tmp_path, env, 3)
    finally:
        spill("down", env=env)
        out, err = launch.communicate(timeout=60)
    assert launch.returncode == 0 and out.count('"passes": ') == 2, out + err[-2000:]   # each follower let go


@ring
def test_a_rank_mlx_launch_started_killed_mid_job_leaves_every_row_written_once(job12, tmp_path, env):
    folder, inp, expected = job12
    slow = {**env, "SPILL_TEST_PASS_DELAY": "0.3", "SPILL_MAX_ROWS": "4"}
    launch, out = _launch(3, slow), tmp_path / "out.jsonl"
    try:
        run, _ = _run_until([folder, inp, "-o", out, "--quiet"], env, out, lines=2)
        last = [p for p in psutil.Process(launch.pid).children(recursive=True)
                if p.environ().get("MLX_RANK") == "2" and "spill.coordinator.cli" in p.cmdline()]
        assert len(last) == 1
        last[0].kill()
        stdout, stderr = run.communicate(timeout=240)
        assert run.returncode == 0, stdout + stderr
        assert texts(read_output(out)) == expected
        lost = [line for line in stdout.splitlines() if line.startswith("note: the group lost")]
        assert re.fullmatch(r"note: the group lost rank [12] on 127\.0\.0\.1 \(rank 0 lost its link to it\); rank 0 "
                            r"goes on alone holding every layer, and the job's unfinished rows are computed again",
                            lost[0]) and len(lost) == 1, stdout   # the rank on the hop rank 0 was using
        assert _stages(env)[0].startswith("stage 0: rank 0 on 127.0.0.1, layers 0-3 of 4")
    finally:
        spill("down", env=env)
        launch.communicate(timeout=60)


@ring
@pytest.mark.parametrize("n,sig,cause", [(3, signal.SIGKILL, "it exited with code -9"),
                                         (2, signal.SIGSTOP, "it did not answer within SPILL_STAGE_TIMEOUT")])
def test_a_follower_of_spill_run_ranks_killed_or_stopped_mid_job_is_named_and_the_job_finishes(
        job12, tmp_path, env, n, sig, cause):
    folder, inp, expected = job12
    slow = {**env, "SPILL_TEST_PASS_DELAY": "0.3", "SPILL_MAX_ROWS": "4", "SPILL_STAGE_TIMEOUT": "3"}
    out = tmp_path / "out.jsonl"

    def started() -> list[str]:   # read while the job starts: on a loaded machine `spill status` outlasted its passes
        stages = [line for line in _stages_now(env) if "pid " in line]
        return stages if len(stages) == n else []
    run, stages = _run_until([folder, inp, "-o", out, "--ranks", n, "--quiet"], slow, out, lines=2, first=started)
    assert [line.split(", ")[0] for line in stages] == [f"stage {r}: rank {r} on 127.0.0.1" for r in range(n)]
    os.kill(_pid(stages[1]), sig)
    stdout, stderr = run.communicate(timeout=240)
    assert run.returncode == 0, stdout + stderr
    assert texts(read_output(out)) == expected
    assert (f"note: the group lost rank 1 on 127.0.0.1 ({cause}); rank 0 goes on alone holding every layer, and "
            "the job's unfinished rows are computed again") in stdout.splitlines(), stdout


@ring
def test_a_job_stopped_on_2_ranks_resumes_on_one_and_writes_every_row_once(job12, tmp_path, env):
    """Resume on fewer hosts: the job's rows are the job's, not the ranks'; `--resume` without --ranks runs one."""
    folder, inp, expected = job12
    out = tmp_path / "out.jsonl"
    slow = {**env, "SPILL_TEST_PASS_DELAY": "0.2", "SPILL_MAX_ROWS": "4"}
    run, _ = _run_until([folder, inp, "-o", out, "--ranks", "2"], slow, out, lines=3)
    run.send_signal(signal.SIGINT)
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 130, stdout + stderr
    job = re.search(r"resume with: spill run --resume (\S+)", stdout).group(1)
    assert 3 <= len(read_output(out)) < 12
    again = spill("run", "--resume", job, "--quiet", env=env, timeout=240)
    assert again.returncode == 0, again.stdout + again.stderr
    assert texts(read_output(out)) == expected   # every custom_id once (read_output fails on a second)


@ring
def test_spill_run_ranks_2_micro_batches_2_writes_the_text_of_one_process(job12, tmp_path, env):
    """Resident (SPILL_STREAM=0), a pipeline (SPILL_REPLICAS=0): the stages run micro-batch outer (admission cuts the
    prompts' groups in 2), and a pass of decode rows alone runs several rounds (stages/rounds.py)."""
    folder, inp, expected = job12
    run = spill("run", folder, inp, "-o", tmp_path / "out.jsonl", "--ranks", "2", "--micro-batches", "2", "--quiet",
                env={**env, "SPILL_STREAM": "0", "SPILL_MAX_ROWS": "4", "SPILL_REPLICAS": "0"}, timeout=240)
    assert "resident: " in run.stdout, run.stdout
    assert run.returncode == 0, run.stdout + run.stderr
    assert texts(read_output(tmp_path / "out.jsonl")) == expected
    job = re.search(r"job (\S+): \d+ rows", run.stdout).group(1)
    passes = history.read(Path(env["SPILL_HOME"]) / "jobs" / job)
    rounds = [p["rounds"] for p in passes if not p["prefill_tokens"]]   # rounds run only where no prompt does
    assert len(rounds) >= 2 and min(rounds) > 1, (passes, run.stdout)


@ring
def test_spill_run_ranks_2_where_each_rank_holds_the_model_runs_replicas_with_the_text_of_one_process(job12, tmp_path,
                                                                                                       env):
    """Resident (SPILL_STREAM=0) and the whole model fits each rank: replicas, each rank a share of the rows."""
    folder, inp, expected = job12
    run = spill("run", folder, inp, "-o", tmp_path / "out.jsonl", "--ranks", "2", "--quiet",
                env={**env, "SPILL_STREAM": "0"}, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "replicas: the whole model (" in run.stdout and "each of 2 ranks; each rank runs every layer" in run.stdout
    assert texts(read_output(tmp_path / "out.jsonl")) == expected   # every custom_id once, resident mlx-lm's text
    job = re.search(r"job (\S+): \d+ rows", run.stdout).group(1)
    passes = history.read(Path(env["SPILL_HOME"]) / "jobs" / job)
    assert max(p["decode_rows"] for p in passes) == 12   # every row at once, over both replicas


@ring
def test_a_replica_of_spill_up_ranks_2_killed_mid_job_is_named_and_the_job_finishes(job12, tmp_path, env):
    folder, inp, expected = job12
    slow = {**env, "SPILL_STREAM": "0", "SPILL_TEST_PASS_DELAY": "0.5", "SPILL_MAX_ROWS": "4"}
    out = tmp_path / "out.jsonl"
    assert spill("up", "--ranks", "2", env=slow).returncode == 0
    try:
        def started() -> list[str]:
            stages = [line for line in _stages_now(env) if "a replica with a share of the rows, pid" in line]
            return stages if len(stages) == 2 else []
        run, stages = _run_until([folder, inp, "-o", out, "--quiet"], slow, out, lines=1, first=started)
        assert [line.split("; ")[0].rsplit(", pid", 1)[0] for line in stages] == [
            f"stage {r}: rank {r} on 127.0.0.1, every layer of 4, a replica with a share of the rows" for r in range(2)]
        os.kill(_pid(stages[1]), signal.SIGKILL)
        stdout, stderr = run.communicate(timeout=240)
        assert run.returncode == 0, stdout + stderr
        assert texts(read_output(out)) == expected   # every custom_id once, the rows rank 1 held computed again
        assert any(line.startswith("note: the group lost rank ") for line in stdout.splitlines()), stdout
    finally:
        spill("down", env=env)


def _cpu_share(pid: int, seconds: float) -> float:
    """The CPU seconds process `pid` (every thread) took over the next `seconds` of wall time, over those seconds."""
    proc = psutil.Process(pid)
    before, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
    time.sleep(seconds)
    return (sum(proc.cpu_times()[:2]) - before) / (time.monotonic() - t0)


@ring
def test_an_idle_follower_of_spill_up_ranks_2_sleeps_before_and_after_a_job_it_runs_row_for_row(job12, tmp_path, env):
    """A follower waits for rank 0's next plan on its doorbell, not in MLX's ring receive (a core while it waits)."""
    folder, inp, expected = job12
    assert spill("up", "--ranks", "2", env=env).returncode == 0
    try:
        follower = _pid(_stages(env)[1])
        assert _cpu_share(follower, 4) < 0.2   # up, no model named: `serve` waits for one
        run = spill("run", folder, inp, "-o", tmp_path / "out.jsonl", "--quiet", env=env, timeout=240)
        assert run.returncode == 0, run.stdout + run.stderr
        assert texts(read_output(tmp_path / "out.jsonl")) == expected
        assert _cpu_share(follower, 4) < 0.2   # its model loaded: `follow` waits for the next pass
        assert _pid(_stages(env)[1]) == follower
        assert re.search(r"link from rank 0 [\d.e-]+ ms and [\d.]+ \S+/s", _stages(env)[1])   # timed at join
    finally:
        spill("down", env=env)


@ring
def test_spill_up_hostfile_starts_a_rank_a_host_through_mlx_launch_and_down_ends_them(job12, tmp_path, env):
    """`spill up --hostfile` is `mlx.launch --hostfile ... -- spill up` in a session of its own: it returns once
    rank 0's group answers with a stage a host; `spill down` lets the others go and mlx.launch ends."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"backend": "ring", "hosts": [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2}))
    env = {**env, "SPILL_RING_PORT": str(_free_run(2))}
    up = spill("up", "--hostfile", hosts, "--metrics-port", "0", env=env, timeout=180)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        said = re.fullmatch(r"spill group up on 2 hosts \(mlx\.launch pid (\d+), its output in (\S+)\); `spill status` "
                            r"shows a stage a host", up.stdout.strip())
        assert said and Path(said[2]) == Path(env["SPILL_HOME"]) / "run" / "logs" / "mlx-launch.out", up.stdout
        lines = _stages(env)   # rank 1 has joined: its line names its own budget
        assert [line.split(",")[0] for line in lines] == ["stage 0: rank 0 on 127.0.0.1", "stage 1: rank 1 on 127.0.0.1"]
        assert "budget" in lines[1] and "(rank 0's)" not in lines[1], lines
        launcher = psutil.Process(int(said[1]))
        again = spill("up", "--hostfile", hosts, env=env)   # a group is up here: no second mlx.launch
        assert again.returncode == 2 and again.stderr.startswith("spill: another spill group is running") and \
            again.stderr.endswith("; `spill down` it before `spill up --hostfile`\n"), again.stderr
        _runs_a_job_row_for_row(job12, tmp_path, env, 2)
    finally:
        spill("down", env=env)
    launcher.wait(120)   # every rank gone: mlx.launch returns
    printed = Path(said[2]).read_text()
    assert printed.count('"passes": ') == 1, printed[-2000:]   # the follower let go


@ring
def test_a_crashed_streamer_of_spill_up_ranks_2_comes_back_with_new_followers(job12, tmp_path, env):
    """The streamer and its followers are one unit: a new ring (new follower, new hostfile) for the new streamer."""
    folder, inp, expected = job12
    assert spill("up", "--ranks", "2", env={**env, "SPILL_TEST_CRASH_STREAMER": "pass:3"}).returncode == 0
    try:
        before = _stages(env)
        run = spill("run", folder, inp, "-o", tmp_path / "out.jsonl", "--quiet", env=env, timeout=240)
        assert run.returncode == 0, run.stdout + run.stderr
        assert texts(read_output(tmp_path / "out.jsonl")) == expected
        after = _stages(env)
        assert [line.rsplit(", pid", 1)[0] for line in after] == [
            "stage 0: rank 0 on 127.0.0.1, layers 0-1 of 4", "stage 1: rank 1 on 127.0.0.1, layers 2-3 of 4"]
        assert _pid(before[1]) != _pid(after[1])
    finally:
        spill("down", env=env)


def _refused(*args, env: dict) -> tuple[int, str]:
    """`spill ARGS`' exit code and stderr, invoked in this process: a refusal starts no group."""
    said = CliRunner().invoke(app, list(map(str, args)), env=env)
    return said.exit_code, said.stderr


def test_more_ranks_than_layers_drafts_or_spill_run_under_mlx_launch_are_refused_at_the_command_line(job12, env):
    folder, inp, _ = job12
    for args in (["up", "--ranks", "5", "--model", folder], ["run", folder, inp, "--ranks", "5"]):
        assert _refused(*args, env=env) == (2, "spill: 5 stages for a model of 4 layers: each stage needs a layer at "
                                               "least; run at most 4 ranks\n")
    for args in (["up", "--ranks", "2", "--micro-batches", "-1"], ["run", folder, inp, "--micro-batches", "-1"]):
        assert _refused(*args, env=env) == (2, "spill: --micro-batches takes 0 (one a rank) or the micro-batches of a "
                                               "pass, 1 or more, found -1\n")
    assert _refused("up", "--ranks", "2", "--speculate", "3", env=env) == (
        2, "spill: drafts are not verified across the ranks of a group yet; with --ranks 2 leave --speculate (or set "
           "it to off) and --draft out\n")
    hosts = Path(env["SPILL_HOME"]) / "hosts.json"
    for text, why in (("{", "Expecting property name"), ('{"hosts": [{"ssh": "a"}]}', "MLX's hostfile names two hosts or more")):
        hosts.write_text(text)
        code, stderr = _refused("up", "--hostfile", hosts, env=env)
        assert code == 2 and stderr.startswith(f"spill: --hostfile {hosts}: {why}"), stderr
    assert _refused("up", "--hostfile", hosts, "--ranks", "2", env=env) == (
        2, "spill: --hostfile starts a rank a host: leave --ranks out, and run it outside mlx.launch\n")
    assert _refused("run", folder, inp, env={**env, "MLX_RANK": "1", "MLX_HOSTFILE": "/nonexistent"}) == (
        2, "spill: mlx.launch starts `spill up` on every rank, not `spill run`: run `mlx.launch ... -- spill up`, then "
           "`spill run` on rank 0's host\n")
    assert spill("status", env=env).stdout.startswith("no spill group is running")


def test_a_job_asking_other_micro_batches_than_the_running_group_is_refused_with_the_fix(tmp_path):
    from spill.coordinator.submit import ranks_refusal
    group = {"ranks": 2, "stages": 1, "micro_batches": 2}
    assert ranks_refusal({"micro_batches": 3}, group, tmp_path, {}) == (
        "the running group runs --micro-batches 2; run without --micro-batches, or `spill down` and run again to start "
        "a group with 3")
    assert ranks_refusal({"micro_batches": 2}, group, tmp_path, {}) is None
    assert ranks_refusal({"micro_batches": 0}, {"ranks": 2, "stages": 1}, tmp_path, {}) is None   # 0: the default
