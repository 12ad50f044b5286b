"""The relay's plans round a real ring on loopback: followers wait for the next one asleep on their doorbell, get
every plan once and in order, and a rank before them that dies ends their wait."""

import json

import mlx.core as mx
import pytest

from spill.stages import launch

ring = pytest.mark.skipif(not mx.distributed.is_available("ring"), reason="this MLX build has no ring backend")

# rank 0 sits idle IDLE_S, sends two plans and dies without a word; a follower times its wait for the first
# (CPU seconds of its whole process, every thread's) and says what its third wait ended with
RANK = """
import json, os, time
from spill.stages.link import join
from spill.stages.relay import Relay, StageLost
relay = Relay(join(), 30.0)
if relay.rank == 0:
    time.sleep(float(os.environ["IDLE_S"]))
    relay.plan(b"one"), relay.plan(b"two")
    os._exit(0)
cpu, wall = time.process_time(), time.monotonic()
got = [relay.plan().decode()]
cpu, wall = time.process_time() - cpu, time.monotonic() - wall
got.append(relay.plan().decode())
try:
    relay.plan()
except StageLost as err:
    print(json.dumps({"plans": got, "cpu": cpu, "wall": wall, "lost": str(err)}))
"""


@ring
def test_a_follower_waits_for_a_plan_asleep_gets_each_once_in_order_and_ends_when_the_rank_before_dies():
    ranks = launch.run(3, ["-c", RANK], timeout=120, env={"IDLE_S": "4"})
    assert [rc for rc, _, _ in ranks] == [0, 0, 0], ranks
    for rank, (_, out, err) in enumerate(ranks[1:], 1):
        said = json.loads(out)
        assert said["plans"] == ["one", "two"], (rank, said)
        assert said["wall"] > 2 and said["cpu"] < 0.2 * said["wall"], (rank, said)   # MLX's ring receive: a core
        assert said["lost"].startswith(f"the pipeline group lost a rank: waiting for a plan from rank {rank - 1} "
                                       "(127.0.0.1:"), (rank, said)
