"""Weight names: a tensor missing from the files, or one the model does not have, is one sentence. A SwiGLU or a
prompt's attention split over CPU streams changes no bit of the output."""

import shutil
import threading

import mlx.core as mx
import pytest

from spill.errors import SpillError
from spill.streamer.core import Row, Streamer
from spill.streamer.streams import cpu_streams


def _edit(make_tiny, tmp_path, drop=(), add=()):
    """A copy of the tiny llama with tensors dropped from, or added to, its one safetensors file."""
    folder = tmp_path / "m"
    shutil.copytree(make_tiny("llama"), folder)
    weights = mx.load(str(folder / "model.safetensors"))
    for name in drop:
        del weights[name]
    for name in add:
        weights[name] = mx.zeros((4,), dtype=mx.bfloat16)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("drop, named", [
    (["model.layers.2.mlp.up_proj.weight"], "model.layers.2.mlp.up_proj.weight"),
    (["model.norm.weight"], "model.norm.weight"),
    (["model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.q_proj.weight"],
     "model.layers.1.self_attn.k_proj.weight (and 1 more)"),
])
def test_a_missing_tensor_is_named(make_tiny, tmp_path, drop, named):
    folder = _edit(make_tiny, tmp_path, drop=drop)
    with pytest.raises(SpillError) as err:
        Streamer(folder)
    assert str(err.value) == (f"model folder {folder}: the weights have no tensor {named}, which a llama "
                              "model needs; the files are incomplete: re-download the model")


@pytest.mark.parametrize("extra", ["model.layers.3.mlp.extra.weight", "model.final_bias"])
def test_an_extra_tensor_is_named(make_tiny, tmp_path, extra):
    folder = _edit(make_tiny, tmp_path, add=[extra])
    with pytest.raises(SpillError) as err:
        Streamer(folder)
    assert str(err.value) == (f"model folder {folder}: the weights hold tensor {extra}, which a llama model "
                              "does not have; check config.json's model_type or re-download the model")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3"])
def test_the_swiglu_split_over_cpu_streams_gives_the_same_logits_bit_for_bit(make_tiny, monkeypatch, family):
    def run(streams: str):
        monkeypatch.setenv("SPILL_ACT_STREAMS", streams)
        engine = Streamer(make_tiny(family), dtype=mx.float32, keep_logits=True, prefill_chunk=16)
        for k in range(24):   # 24 rows: over the split's 16 with two streams
            engine.add(Row(f"r{k}", [(7 * k + j) % 50 + 3 for j in range(3 + k % 5)], 4))
        logits = []
        while not engine.idle:
            logits += [(e.row_id, e.logits.tobytes()) for e in engine.step().emitted]
        engine.close()
        return sorted(logits)

    entered = []
    stream = mx.stream
    monkeypatch.setattr(mx, "stream", lambda s: entered.append(s) or stream(s))
    whole = run("1")
    assert not entered
    split = run("2")
    assert entered and split == whole and len(whole) == 24 * 4


def _attention_split(monkeypatch, make_tiny, family, rows, chunk=24):
    """Each row's logits (bytes) with SPILL_ACT_STREAMS 1 and 2, and the query shapes attention saw inside a split."""
    inside, split = [], []
    stream, sdpa = mx.stream, mx.fast.scaled_dot_product_attention

    class Inside:   # mx.stream, noting when attention runs inside one
        def __init__(self, s):
            self.context = stream(s)

        def __enter__(self):
            inside.append(self.context.__enter__())

        def __exit__(self, *exc):
            inside.pop()
            return self.context.__exit__(*exc)

    def attention(q, *args, **kwargs):
        if inside:
            split.append(q.shape)
        return sdpa(q, *args, **kwargs)
    monkeypatch.setattr(mx, "stream", Inside)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", attention)

    def run(streams: str):
        monkeypatch.setenv("SPILL_ACT_STREAMS", streams)
        engine = Streamer(make_tiny(family), dtype=mx.float32, keep_logits=True, prefill_chunk=chunk)
        for row in rows:
            engine.add(row)
        logits = []
        while not engine.idle:
            logits += [(e.row_id, e.logits.tobytes()) for e in engine.step().emitted]
        engine.close()
        return sorted(logits)

    whole = run("1")
    assert not split
    return whole, run("2"), split


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3", "phi3"])
@pytest.mark.parametrize("rows", [1, 5])   # one row: split by its KV heads; several: by rows
def test_a_prompts_attention_split_over_cpu_streams_gives_the_same_logits_bit_for_bit(make_tiny, monkeypatch,
                                                                                         family, rows):
    # prompts of 29-45 tokens in chunks of 24: the second chunk attends to the first's KV
    prompts = [Row(f"r{k}", [(7 * k + 3 * j) % 50 + 3 for j in range(29 + 4 * k)], 3) for k in range(rows)]
    whole, split, queries = _attention_split(monkeypatch, make_tiny, family, prompts)
    assert split == whole and len(whole) == rows * 3
    assert queries and all(q[2] > 1 for q in queries), queries   # decode's stays whole under 8 rows


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
def test_a_decode_steps_attention_split_by_rows_gives_the_same_logits_bit_for_bit(make_tiny, monkeypatch, family):
    # two decode pools (widths 64 and 128) of 17 and 16 rows: each pool's attention split over the two streams
    rows = [Row(f"r{k}", [(5 * k + j) % 40 + 3 for j in range(4 + k % 3)], 6, width=64 if k < 17 else 128)
            for k in range(33)]
    whole, split, queries = _attention_split(monkeypatch, make_tiny, family, rows, chunk=256)
    assert split == whole and len(whole) == 33 * 6
    decode = [q for q in queries if q[2] == 1]
    assert sorted({q[0] for q in decode}) == [8, 9], decode   # halves of 17 and 16 rows


def test_decode_pools_too_small_to_split_run_whole_on_streams_side_by_side(make_tiny, monkeypatch):
    """The 53-row mixed-length job decoded 53 rows in 11 pools: under 16 rows none was split, so each pool's attention
    ran after the last on one thread (48 rows at 1,024 tokens: 12 pools 110 ms a pass, one pool 62). Each such pool
    now runs whole on a stream of its own, the same kernel: the logits are bit for bit the same."""
    rows = [Row(f"r{k}", [(3 * k + j) % 40 + 3 for j in range(4 + k % 3)], 6, width=(64, 128, 192)[k % 3])
            for k in range(15)]
    whole, split, queries = _attention_split(monkeypatch, make_tiny, "llama", rows, chunk=256)
    assert split == whole and len(whole) == 15 * 6
    assert sorted({q[0] for q in queries if q[2] == 1}) == [5], queries   # each pool's 5 rows whole, on a stream


def test_a_thread_makes_its_cpu_streams_once_and_computes_only_on_its_own(make_tiny, monkeypatch):
    """Each MLX CPU stream is a thread for the life of the process, and belongs to the thread that made it: a group
    loading model after model makes none anew, and an engine computing in another thread splits on streams of its own."""
    monkeypatch.setenv("SPILL_ACT_STREAMS", "2")
    prompt = [5, 6, 7, 8, 9, 10]   # a prompt's attention: split by its two KV heads
    first = Streamer(make_tiny("llama"))
    first.add(Row("a", prompt, 2))
    first.step()
    made, new, again = cpu_streams(2), mx.new_stream, []
    monkeypatch.setattr(mx, "new_stream", lambda device: again.append(device) or new(device))
    for family in ("qwen2", "llama"):
        engine = Streamer(make_tiny(family))
        engine.add(Row("a", prompt, 2))
        engine.step()
        engine.close()
    assert cpu_streams(2) == made and len(made) == 2 and not again
    first.close()
    out = []

    def elsewhere():   # an engine made and run on another thread
        engine = Streamer(make_tiny("llama"))
        engine.add(Row("a", prompt, 2))
        out.append([e.token for e in engine.step().emitted] + [e.token for e in engine.step().emitted])
        out.append(cpu_streams(2))
        engine.close()
    worker = threading.Thread(target=elsewhere)
    worker.start()
    worker.join(60)
    assert len(out) == 2 and len(out[0]) == 2 and len(again) == 2 and out[1] != made
