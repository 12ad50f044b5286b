"""One peer at one batch, run by `peers.py` inside the memory cgroup; prints one JSON line at the end.

    python benchmarks/peers_child.py llama.cpp|accelerate|mlx-lm SPEC.json

SPEC.json: {"model": folder, "gguf": file, "prompts": [[ids]...], "new": 32, "threads": 2, "offload": dir,
"hf_dtype": "float32", "gpu_cap": bytes or null, "hf_gpu_share": share of gpu_cap for accelerate's weights}.
Every peer runs greedy: one prefill of the batch's prompts (timed apart), then `new` decode steps of
one token per row, each step timed. Stage lines go to stderr, so a killed child still shows how far it got.
Where a GPU is, a peer holding more GPU memory than gpu_cap exits with OVER_CAP (the cgroup caps host memory only).
"""

import json
import resource
import sys
import time

import numpy as np


OVER_CAP = 5


def stage(name: str, **kw) -> None:
    print(json.dumps({"stage": name, "t": time.time(), **kw}), file=sys.stderr, flush=True)


def over_cap(peak: int, cap: int, when: str) -> None:
    stage("over-cap", gpu_peak=int(peak), when=when)
    print(f"GPU memory {peak / 2**30:.2f} GiB {when}, over the cap of {cap / 2**30:.2f} GiB", file=sys.stderr)
    sys.exit(OVER_CAP)


# -- llama.cpp through llama-cpp-python's low-level API, weights mmapped -----------------------------------
def llama_cpp(spec: dict) -> dict:
    import llama_cpp as L
    prompts, new = spec["prompts"], spec["new"]
    b, n = len(prompts), len(prompts[0])
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_mmap, mp.use_mlock = True, False
    if hasattr(mp, "use_extra_bufts"):
        mp.use_extra_bufts = False   # no CPU repacking: it copies the weights into anonymous memory
    model = L.llama_model_load_from_file(spec["gguf"].encode(), mp)
    if not model:
        raise SystemExit("llama.cpp could not load the GGUF")
    cp = L.llama_context_default_params()
    per_seq = -(-(n + new + 1) // 128) * 128   # KV cells per row: anonymous memory under the cap
    cp.n_ctx, cp.n_seq_max = per_seq * b, b
    cp.n_batch, cp.n_ubatch = b * n, min(512, b * n)   # prefill in ubatches of 512: a small compute buffer
    cp.n_threads = cp.n_threads_batch = spec["threads"]
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit("llama.cpp could not make a context")
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(b * n, 0, b)

    def decode(tokens: list[list[int]], pos: int) -> list[int]:
        """One llama_decode of every row's tokens at positions pos..; the rows' greedy next tokens."""
        k = 0
        for s, toks in enumerate(tokens):
            for j, t in enumerate(toks):
                batch.token[k], batch.pos[k], batch.n_seq_id[k] = t, pos + j, 1
                batch.seq_id[k][0], batch.logits[k] = s, j == len(toks) - 1
                k += 1
        batch.n_tokens = k
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        out, k = [], -1
        for toks in tokens:
            k += len(toks)
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, k), shape=(vocab,))
            out.append(int(logits.argmax()))
        return out

    stage("loaded")
    t0 = time.perf_counter()
    nxt = decode(prompts, 0)
    prefill = time.perf_counter() - t0
    steps, first = [], [nxt[0]]
    stage("prefilled", seconds=prefill, token=first[0])
    for i in range(new - 1):
        t0 = time.perf_counter()
        nxt = decode([[t] for t in nxt], n + i)
        steps.append(time.perf_counter() - t0)
        first.append(nxt[0])
        stage("step", i=i, seconds=steps[-1], token=first[-1])
    version = getattr(L, "__version__", "?") + ("" if L.llama_supports_gpu_offload() else " (CPU build)")
    L.llama_batch_free(batch)
    return {"prefill_s": prefill, "steps": steps, "tokens": first, "version": f"llama-cpp-python {version}"}


# -- Hugging Face transformers + accelerate, every layer offloaded to disk --------------------------------------
def accelerate(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, spec.get("hf_dtype", "float32"))
    cap = spec.get("gpu_cap")
    gpu = bool(cap) and torch.cuda.is_available()   # peers.py sets a GPU cap wherever it sees a GPU
    memory = {"cpu": spec.get("hf_cpu", "64MiB")}
    if gpu:   # torch refuses past the cap; a share of it (half by default) holds weights, the rest KV and activations
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
        memory[0] = int(cap * spec.get("hf_gpu_share", 0.5))
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=dtype, device_map="auto", max_memory=memory,
        offload_folder=spec["offload"], offload_state_dict=True)
    model.eval()
    placed = sorted(set(getattr(model, "hf_device_map", {}).values()), key=str)
    stage("loaded", devices=[str(d) for d in placed])
    ids = torch.tensor(spec["prompts"], dtype=torch.long, device="cuda" if gpu else "cpu")
    try:
        return _hf_generate(model, ids, spec, placed, torch)
    except torch.OutOfMemoryError:
        over_cap(torch.cuda.max_memory_allocated(), cap, "(torch refused an allocation)")


def _hf_generate(model, ids, spec: dict, placed, torch) -> dict:
    import accelerate as acc
    import transformers
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)   # the last position's, as generate() keeps
        prefill = time.perf_counter() - t0
        past, nxt = out.past_key_values, out.logits[:, -1, :].argmax(-1)
        steps, first = [], [int(nxt[0])]
        stage("prefilled", seconds=prefill, token=first[0])
        for i in range(spec["new"] - 1):
            t0 = time.perf_counter()
            out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1, :].argmax(-1)
            steps.append(time.perf_counter() - t0)
            first.append(int(nxt[0]))
            stage("step", i=i, seconds=steps[-1], token=first[-1])
    gpu_peak = torch.cuda.max_memory_allocated() if ids.is_cuda else None
    return {"prefill_s": prefill, "steps": steps, "tokens": first, "devices": [str(d) for d in placed],
            "gpu_share": spec.get("hf_gpu_share") if ids.is_cuda else None,
            "gpu_peak": gpu_peak, "version": f"transformers {transformers.__version__}, accelerate {acc.__version__}, torch {torch.__version__}"}


# -- mlx-lm with the model resident (loaded whole) ---------------------------------------------------------------
def mlx_lm(spec: dict) -> dict:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load
    model, _ = load(spec["model"])   # not lazy: every weight in memory before the first token
    mx.eval(model.parameters())
    gpu, cap = mx.default_device() == mx.gpu, spec.get("gpu_cap")
    if gpu and cap and mx.get_peak_memory() > cap:
        over_cap(mx.get_peak_memory(), cap, "at load")
    stage("loaded")
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    nxt = mx.argmax(model(mx.array(spec["prompts"]), cache=cache)[:, -1, :], axis=-1)
    mx.eval(nxt)
    prefill = time.perf_counter() - t0
    steps, first = [], [int(nxt[0])]
    stage("prefilled", seconds=prefill, token=first[0])
    for i in range(spec["new"] - 1):
        t0 = time.perf_counter()
        nxt = mx.argmax(model(nxt[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.eval(nxt)
        steps.append(time.perf_counter() - t0)
        first.append(int(nxt[0]))
        stage("step", i=i, seconds=steps[-1], token=first[-1])
    if gpu and cap and mx.get_peak_memory() > cap:
        over_cap(mx.get_peak_memory(), cap, "decoding")
    return {"prefill_s": prefill, "steps": steps, "tokens": first, "gpu_peak": mx.get_peak_memory() if gpu else None,
            "version": f"mlx-lm {mlx_lm.__version__}, mlx {mx.__version__}"}


def peak_rss() -> int:
    """This process's peak resident memory since it started its program (VmHWM): ru_maxrss outlives exec, so it
    also held the forking parent's RSS (ru_maxrss gave peers.py's own 2,655 MiB for every peer)."""
    with open("/proc/self/status") as f:
        hwm = next((line.split()[1] for line in f if line.startswith("VmHWM:")), None)
    return int(hwm) * 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


PEERS = {"llama.cpp": llama_cpp, "accelerate": accelerate, "mlx-lm": mlx_lm}

if __name__ == "__main__":
    peer = sys.argv[1]
    with open(sys.argv[2]) as f:
        spec = json.load(f)
    result = PEERS[peer](spec)
    result["maxrss"] = peak_rss()
    print(json.dumps(result), flush=True)
