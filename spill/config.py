"""Every SPILL_* environment variable, declared once (name, default, type, meaning, category) and read here.

Categories: USER (the table in docs/configuration.md), TUNING (its "Tuning" section: the engine's own
choices, for measuring), TEST (SPILL_TEST_DROP and the like: faults, test sizes), INTERNAL (set by spill).
A flag of `spill up` or `spill run` reaches the group as an argument of its processes, never through here.
"""

import os
from dataclasses import dataclass
from pathlib import Path

USER, TUNING, TEST, INTERNAL = "user", "tuning", "test", "internal"
ROLES = ("coordinator", "tokenizer", "admission", "streamer")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class Knob:
    name: str
    default: str      # as the environment spells it; "" is unset (the code's own choice)
    type: type        # int, float, str or bool ("0" and "" are false)
    meaning: str
    category: str


KNOBS = {k.name: k for k in (
    Knob("SPILL_HOME", "~/.streamweights", str, "the data home: models/, jobs/, calibration/, run/, cache/", USER),
    Knob("SPILL_TOKEN", "", str, "the token every tcp control request carries (default: made at start, "
         "in run/control.token)", USER),
    Knob("SPILL_STREAM", "0", bool, "1: stream every pass even where the model fits resident, as --stream", USER),
    Knob("SPILL_METRICS_PORT", "9464", int, "port of the group's Prometheus endpoint (`spill up --metrics-port`); "
         "0 serves none", USER),
    Knob("SPILL_METRICS_HOST", "127.0.0.1", str, "address of the endpoint (`spill up --metrics-host`)", USER),
    Knob("SPILL_LOG_LEVEL", "info", str, "lowest level the actors log; warning drops the per-pass lines", USER),
    Knob("SPILL_LOG_MAX_BYTES", str(20 * 10**6), int, "size at which an actor's JSON log rotates", USER),
    Knob("SPILL_LOG_BACKUPS", "3", int, "rotated logs kept per actor besides the live one", USER),
    Knob("SPILL_NO_OPENBLAS", "0", bool, "1: do not preload OpenBLAS on Linux, and do not warn that it is missing",
         USER),
    Knob("SPILL_MAX_ROWS", "256", int, "decode slots at most; the memory budget sizes the batch below it", TUNING),
    Knob("SPILL_PREFILL_TOKENS", "4096", int, "prompt tokens started per pass, at most", TUNING),
    Knob("SPILL_GUARD_LINE", "", float, "share of the working set above which nothing new is admitted "
         "(default 0.80, 0.93 on a CUDA GPU, and 2 points above a higher --budget-fraction)", TUNING),
    Knob("SPILL_HARD_LINE", "", float, "share above which the newest rows are preempted (default 0.90, 0.97 on a "
         "CUDA GPU, and 4 points above a higher --budget-fraction)", TUNING),
    Knob("SPILL_SUBMIT_WINDOW", "1024", int, "rows of a job submitted to the group and unfinished at once; keep it "
         "well above the largest batch", TUNING),
    Knob("SPILL_CLIENT_TIMEOUT", "10", float, "seconds a queued job waits for its `spill run` to ask about it "
         "before it leaves the queue", TUNING),
    Knob("SPILL_READY_TIMEOUT", "120", float, "seconds an actor has to say READY after it starts", TUNING),
    Knob("SPILL_LIVENESS_TIMEOUT", "30", float, "seconds without a heartbeat before an actor is restarted", TUNING),
    Knob("SPILL_STALL_TIMEOUT", "30", float, "seconds every actor may sit idle with rows of the running job out "
         "before the coordinator takes them for lost and submits them again", TUNING),
    Knob("SPILL_WEDGE_TIMEOUT", "600", float, "seconds an actor may work without its loop coming round before it "
         "is restarted; at least 10 of the last pass", TUNING),
    Knob("SPILL_RING_PORT", "32323", int, "the ring's first port for `spill up --hostfile` (mlx.launch's -p): rank r "
         "listens on it plus r", USER),
    Knob("SPILL_STAGE_TIMEOUT", "600", float, "seconds a pipeline stage waits on its neighbour within a pass "
         "(hidden states, tokens) before it takes the group for lost", TUNING),
    Knob("SPILL_MAX_MESSAGE_MB", "256", float, "frames above this size are refused on every socket", TUNING),
    Knob("SPILL_ESTIMATE_APART", "1", bool, "0: count a job's tokens (and calibrate) in a thread of the "
         "coordinator, not in a child (~3 s a job; the child keeps no tokenizer in the group)", TUNING),
    Knob("SPILL_READ_THREADS", "4", int, "threads reading one layer's chunks at once (queue depth for the disk)",
         TUNING),
    Knob("SPILL_CONVERT_THREADS", "", int, "threads converting a layer's tensors into MLX arrays (default half the "
         "cores, at most 8)", TUNING),
    Knob("SPILL_BLAS_THREADS", "0", int, "OpenBLAS threads for the layer math on the CPU (0: chosen each pass)",
         TUNING),
    Knob("SPILL_READ_SLOTS", "0", int, "read-ahead buffers, a layer of memory each (0: 2; 1 on a CPU of fewer "
         "than 8 cores)", TUNING),
    Knob("SPILL_LAYERS_IN_FLIGHT", "0", int, "converted layers alive at once, 1 or 2 (0: 2; 1 on a CUDA GPU)",
         TUNING),
    Knob("SPILL_ACT_STREAMS", "", int, "CPU streams a SwiGLU and a prompt's attention are split over; 1 turns "
         "it off (default one a core, at most 8; 1 on a GPU)", TUNING),
    Knob("SPILL_CHUNK_ATTENTION", "", str, "fused or ops: how a chunk of drafts attends (default ops on a CUDA GPU, "
         "whose fused kernel plans each new shape; fused elsewhere)", TUNING),
    Knob("SPILL_REPLICAS", "1", bool, "0: a group of several ranks runs a pipeline even where every rank holds the "
         "whole model (the advisor's replicas, stages/replicas.py)", TUNING),
    Knob("SPILL_ROUNDS", "8", int, "decode rounds a pass of decode rows alone may run on a resident pipeline "
         "(stages/rounds.py); 1: one a pass", TUNING),
    Knob("SPILL_DIRECT_IO", "1", bool, "0: read weights through the page cache, dropping behind, not O_DIRECT",
         TUNING),
    Knob("SPILL_HUGE_PAGES", "1", bool, "0: leave MLX's 4 KiB pages under the read buffers (Linux)", TUNING),
    Knob("SPILL_READ_INTO", "", str, "where the reader reads: mlx, buffers or pinned (default mlx; pinned on a "
         "CUDA GPU)", TUNING),
    *(Knob(f"SPILL_TEST_CRASH_{role.upper()}", "", str, f"event:n[:wedge]: crash the {role} at its n-th event, "
           "or with :wedge stop its loop there (its heartbeat goes on)", TEST) for role in ROLES),
    Knob("SPILL_TEST_DROP", "", str, "KIND:n: a process loses the n-th message of that kind it sends, as ZeroMQ "
         "loses an oversized frame", TEST),
    Knob("SPILL_TEST_ALLOC_FAIL", "", str, "n[:every]: the n-th buffer the weight reader allocates raises as MLX "
         "does when it cannot allocate, in the group's first streamer (:every: in each one replacing it too)", TEST),
    Knob("SPILL_TEST_ESTIMATE_DELAY", "0", float, "seconds a job's estimate waits before it starts", TEST),
    Knob("SPILL_TEST_PASS_DELAY", "0", float, "seconds the streamer sleeps after each pass, to widen a race", TEST),
    Knob("SPILL_TEST_READ_RATE", "0", float, "bytes/s the weight reader reads at most: a slow disk under a fast "
         "compute, as on the machines spill is for (0: as fast as it reads)", TEST),
    Knob("SPILL_TEST_FUZZ_EXAMPLES", "60", int, "examples each fuzz test generates", TEST),
    Knob("SPILL_TEST_BENCH_MODELS", "/tmp/spill-bench", str, "the benchmarks' model folder", TEST),
    Knob("_SPILL_REEXEC", "0", bool, "set by `spill` (or a benchmark) when it restarts itself with OpenBLAS "
         "preloaded", INTERNAL),
)}


def get(name: str, env=None):
    """The declared variable `name` from `env` (default the process's environment), typed; None where it and its
    default are unset. A value that does not parse is one sentence naming the variable."""
    knob = KNOBS[name]
    raw = (os.environ if env is None else env).get(name, "").strip() or knob.default
    if knob.type is bool:
        return raw not in ("", "0")
    if not raw:
        return None
    try:
        return knob.type(raw)
    except ValueError:
        from .errors import SpillError
        raise SpillError(f"{name}={raw!r} is not {'a whole number' if knob.type is int else 'a number'}; "
                         f"set it to one ({knob.meaning}), or unset it") from None


def check_writable(run_dir: Path) -> None:
    """SpillError naming SPILL_HOME when a folder of the data home cannot be made or written."""
    import tempfile
    from .errors import SpillError
    try:
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=run_dir).close()
    except OSError as err:
        raise SpillError(f"cannot write to {run_dir} ({err.strerror}); set SPILL_HOME to a folder you can write "
                         f"(the data home is {home()})") from None


def home() -> Path:
    return Path(get("SPILL_HOME")).expanduser()


def crash_name(role: str) -> str:
    return f"SPILL_TEST_CRASH_{role.upper()}"


def crash_knob(role: str) -> str:
    return get(crash_name(role)) or ""


def ready_timeout() -> float:
    return get("SPILL_READY_TIMEOUT")


def max_rows() -> int:
    return get("SPILL_MAX_ROWS")


def rounds() -> int:
    """Decode rounds a pass of a resident pipeline may run (SPILL_ROUNDS), at least one."""
    return max(1, get("SPILL_ROUNDS"))


def guard_line(gpu: bool = False, fraction: float = 0.0) -> float:
    """SPILL_GUARD_LINE where set; else 0.80 (0.93 on a CUDA GPU's own memory, `gpu`: 3 points above its budget as
    0.80 is 2 above 0.78), and 2 points above a budget `fraction` set higher."""
    chosen = get("SPILL_GUARD_LINE")
    return chosen if chosen is not None else min(1.0, max(0.93 if gpu else 0.80, fraction + 0.02))


def hard_line(gpu: bool = False, fraction: float = 0.0) -> float:
    """SPILL_HARD_LINE where set; else 0.90 (0.97 on a CUDA GPU's own memory), and 4 points above a budget
    `fraction` set higher."""
    chosen = get("SPILL_HARD_LINE")
    return chosen if chosen is not None else min(1.0, max(0.97 if gpu else 0.90, fraction + 0.04))


def prefill_tokens() -> int:
    return get("SPILL_PREFILL_TOKENS")


def ring_port() -> int:
    return get("SPILL_RING_PORT")


def stage_timeout() -> float:
    return get("SPILL_STAGE_TIMEOUT")


def test_pass_delay() -> float:
    return get("SPILL_TEST_PASS_DELAY")


def test_read_rate() -> float:
    return get("SPILL_TEST_READ_RATE")


def test_estimate_delay() -> float:
    return get("SPILL_TEST_ESTIMATE_DELAY")


def test_drop() -> tuple[str, int]:
    """SPILL_TEST_DROP="SUBMIT:n" as ("SUBMIT", n); ("", 0) unset."""
    kind, _, n = (get("SPILL_TEST_DROP") or "").partition(":")
    return (kind.upper(), int(n)) if n else ("", 0)


def test_alloc_fail() -> tuple[int, bool]:
    """SPILL_TEST_ALLOC_FAIL="n[:every]" as (n, every); (0, False) unset."""
    n, _, every = (get("SPILL_TEST_ALLOC_FAIL") or "").partition(":")
    return int(n or 0), every == "every"


def test_fuzz_examples() -> int:
    return get("SPILL_TEST_FUZZ_EXAMPLES")


def read_threads() -> int:
    return max(1, get("SPILL_READ_THREADS"))


def convert_threads() -> int:
    chosen = get("SPILL_CONVERT_THREADS")
    return max(1, chosen if chosen is not None else min(8, (os.cpu_count() or 2) // 2))


def blas_threads() -> int:
    return max(0, get("SPILL_BLAS_THREADS"))


def read_slots() -> int:
    """0: `platform.read_slots` chooses."""
    return max(0, get("SPILL_READ_SLOTS"))


def layers_in_flight() -> int:
    """0: `platform.layers_in_flight` chooses."""
    return min(2, max(0, get("SPILL_LAYERS_IN_FLIGHT")))


def activation_streams() -> int | None:
    """None: `platform.activation_streams` chooses."""
    return get("SPILL_ACT_STREAMS")


def direct_io() -> bool:
    return get("SPILL_DIRECT_IO")


def huge_pages() -> bool:
    return get("SPILL_HUGE_PAGES")


def chunk_attention() -> str | None:
    """"fused" (MLX's attention kernel) or "ops" (scores, softmax, values); None: the device's default (platform.py)."""
    chosen = get("SPILL_CHUNK_ATTENTION")
    if chosen not in (None, "fused", "ops"):
        from .errors import SpillError
        raise SpillError(f"SPILL_CHUNK_ATTENTION={chosen} is not an attention setting: use fused or ops, or unset it "
                         "for the device's default")
    return chosen


def read_into() -> str | None:
    """"mlx" (straight into MLX-owned memory), "buffers" (the reader's own, copied out) or "pinned" (its own
    page-locked ones, copied by a CUDA GPU's copy engine); None: the device's default (platform.py)."""
    chosen = get("SPILL_READ_INTO")
    if chosen not in (None, "mlx", "buffers", "pinned"):
        from .errors import SpillError
        raise SpillError(f"SPILL_READ_INTO={chosen} is not a reader setting: use mlx, buffers or pinned, "
                         "or unset it for the device's default")
    return chosen


def max_message_bytes() -> int:
    return int(get("SPILL_MAX_MESSAGE_MB") * (1 << 20))


def liveness_timeout() -> float:
    """The heartbeat comes from a thread, so a long pass keeps beating; a stopped or wedged process does not."""
    return get("SPILL_LIVENESS_TIMEOUT")


def stall_timeout() -> float:
    return get("SPILL_STALL_TIMEOUT")


def wedge_timeout(pass_s: float = 0.0) -> float:
    """The larger of SPILL_WEDGE_TIMEOUT (a first pass reads the whole model) and 10 of the last pass."""
    return max(get("SPILL_WEDGE_TIMEOUT"), 10 * pass_s)


def client_timeout() -> float:
    return get("SPILL_CLIENT_TIMEOUT")


def metrics_host() -> str:
    return get("SPILL_METRICS_HOST")


def metrics_port() -> int:
    return get("SPILL_METRICS_PORT")


def token() -> str:
    return get("SPILL_TOKEN") or ""


def log_max_bytes() -> int:
    return get("SPILL_LOG_MAX_BYTES")


def log_backups() -> int:
    return get("SPILL_LOG_BACKUPS")


def log_level() -> str:
    level = get("SPILL_LOG_LEVEL").lower()
    if level not in LOG_LEVELS:
        from .errors import SpillError
        raise SpillError(f"SPILL_LOG_LEVEL={os.environ['SPILL_LOG_LEVEL']!r} is not a log level; "
                         f"set it to {', '.join(LOG_LEVELS[:-1])} or {LOG_LEVELS[-1]}, or unset it")
    return level


def estimate_apart() -> bool:
    """1: a submitted job's estimate in a child process, so the coordinator holds no tokenizer for the group's life
    (47 MB on lean45, `benchmarks/group_memory.py`); 0: in a thread (the test suite's many short jobs)."""
    return get("SPILL_ESTIMATE_APART")


def replicas() -> bool:
    """Whether the advisor may run several ranks as replicas (SPILL_REPLICAS), each the whole model."""
    return get("SPILL_REPLICAS")


def stream() -> bool:
    """The default of --stream: the advisor otherwise keeps a model that fits resident."""
    return get("SPILL_STREAM")


def no_openblas(env=None) -> bool:
    return get("SPILL_NO_OPENBLAS", env)


BUDGET_FRACTION = 0.78   # --budget-fraction: the share of the working set live allocation aims at
# ... on a CUDA GPU, whose own memory holds no page cache and nothing of the OS's: no knee to stay under, and the
# GPU sheet priced the H200's peak 265-500 MiB above MLX's at a 3 GiB cap (`benchmarks/peers.py`); the host's stays 0.78
GPU_BUDGET_FRACTION = 0.90


def submit_window() -> int:
    return get("SPILL_SUBMIT_WINDOW")
