"""One owner for a row's life: the scheduler. Every per-row container in the product is read from its source
and must be one this list names, with what it may hold; a new one elsewhere fails here."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("admission", "coordinator", "streamer", "tokenizer_worker", "spill")
# words that name a row's life in an attribute: a container of rows under one of them keeps a row's status
LIFE = ("pending", "in_flight", "running", "started", "prefilling", "decoding", "preempting", "queue", "live",
        "status", "deferred", "waiting", "rows", "tails", "done", "stops", "finished", "left")
ALLOWED = {
    # the scheduler: every row's status, its queue and its groups
    ("admission/scheduler.py", "status"), ("admission/scheduler.py", "stops"), ("admission/scheduler.py", "deferred"),
    ("admission/policy.py", "queue"), ("admission/policy.py", "running"),
    # the streamer's tensor state keyed by row id, and the rows of a caller that plans alone
    ("streamer/core.py", "rows"), ("streamer/core.py", "waiting"), ("streamer/core.py", "left"),
    ("streamer/groups.py", "rows"),
    # the coordinator: what is written (the job store) and what is outstanding; the live view's last text
    ("coordinator/jobstore.py", "_done"), ("coordinator/jobrun.py", "pending"), ("coordinator/jobrun.py", "in_flight"),
    ("coordinator/jobrun.py", "tails"),
    # the tokenizer: the detokenizer of each row whose text it follows
    ("tokenizer_worker/core.py", "live"),
    # not rows: the daemon's queue of jobs and its actors not READY yet
    ("coordinator/daemon.py", "queue"), ("coordinator/daemon.py", "waiting"),
}
CONTAINERS = (ast.Dict, ast.Set, ast.List, ast.DictComp, ast.SetComp, ast.ListComp)


def _is_container(value) -> bool:
    if isinstance(value, CONTAINERS):
        return True
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id in ("dict", "set", "list", "deque", "OrderedDict", "Counter", "defaultdict"))


def _pairs(node):
    """(target, value) of an assignment, a tuple assigned to a tuple element by element."""
    if isinstance(node, ast.AnnAssign) and node.value is not None:
        return [(node.target, node.value)]
    if not isinstance(node, ast.Assign):
        return []
    out = []
    for target in node.targets:
        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) and len(target.elts) == len(node.value.elts):
            out += zip(target.elts, node.value.elts)
        else:
            out.append((target, node.value))
    return out


def per_row_containers() -> set[tuple[str, str]]:
    """(file, attribute) of every `self.<attr> = <container>` whose name speaks of a row's life."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                for target, value in _pairs(node):
                    if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                            and target.value.id == "self" and _is_container(value)
                            and any(word in target.attr for word in LIFE)):
                        found.add((str(path.relative_to(ROOT)), target.attr))
    return found


def test_a_rows_life_is_kept_by_the_scheduler_alone():
    kept = per_row_containers()
    assert kept - ALLOWED == set(), "a row's life kept outside the scheduler: let the scheduler own it"


def test_the_walk_finds_what_it_looks_for():
    """The walk sees the containers this list allows (a walk that finds nothing would pass anything)."""
    kept = per_row_containers()
    assert {("admission/scheduler.py", "status"), ("coordinator/jobrun.py", "pending")} <= kept
