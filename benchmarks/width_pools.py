"""Decode pass time on the lean model: 18 rows in one pool (width 1280) against the same rows in three pools
(256, 768, 1280), alternated; run with OpenBLAS preloaded (LD_PRELOAD=.../libopenblas.so.0)."""
import statistics
import sys

from spill.streamer.core import Row, Streamer

folder = sys.argv[1] if len(sys.argv) > 1 else "/tmp/spill-bench/llama-lean-float32-seed0"
s = Streamer(folder, prefill_chunk=512)
def run(layout, passes=4):
    s.clear()
    s.reserve(layout["pools"])
    for j, w in enumerate(layout["widths"]):
        s.add(Row(f"r{j}", [(7 * j + k) % 1000 + 3 for k in range(20)], max_tokens=64, width=w))
    s.step()   # the prefill pass
    out = []
    for _ in range(passes):
        r = s.step()
        out.append((r.compute_s, r.seconds))
    return out
one = {"pools": [[18, 1280]], "widths": [1280] * 18}
three = {"pools": [[7, 256], [6, 768], [5, 1280]], "widths": [256] * 7 + [768] * 6 + [1280] * 5}
res = {"one": [], "three": []}
for rnd in range(2):
    for name, layout in (("one", one), ("three", three)):
        res[name] += run(layout)
        print(name, rnd, [f"{c:.2f}/{t:.2f}" for c, t in res[name][-4:]], flush=True)
for name, v in res.items():
    print(name, "median compute %.3f s, pass %.3f s" % (statistics.median(c for c, _ in v), statistics.median(t for _, t in v)))
