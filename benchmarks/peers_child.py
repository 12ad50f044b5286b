"""One peer at one batch, run by `peers.py` inside the memory cgroup; prints one JSON line at the end.

    python benchmarks/peers_child.py llama.cpp|accelerate|mlx-lm SPEC.json

SPEC.json: {"model": folder, "gguf": file, "prompts": [[ids]...], "new": 32, "threads": 2, "offload": dir,
"hf_dtype": "float32", "gpu_cap": bytes or null, "hf_gpu_share": share of gpu_cap for accelerate's weights,
"kv": llama.cpp's KV cache type (f16, q8_0), "eos": [ids], "pad": id}. Prompts may differ in length: llama.cpp
places each row at its own positions, accelerate and mlx-lm pad on the left (an attention mask, each row's
positions from 0). Every peer runs greedy: one prefill of the batch's prompts (timed apart), then `new` - 1
decode steps of one token per row, each step timed, with no stop at EOS (where each row would stop is counted). Stage lines go to stderr, so a killed child still shows how far it got.
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


def generate(prefill, step, new: int, eos: list[int]) -> dict:
    """Greedy, no EOS stop: `prefill()` (timed apart) gives each row's first token, then `new` - 1 calls of
    `step(last tokens, i)` one token a row, each timed. Row 0's tokens, and each row's up to its first EOS."""
    t0 = time.perf_counter()
    nxt = prefill()
    prefill_s, rows, steps = time.perf_counter() - t0, [[t] for t in nxt], []
    stage("prefilled", seconds=prefill_s, token=nxt[0])
    for i in range(new - 1):
        t0 = time.perf_counter()
        nxt = step(nxt, i)
        steps.append(time.perf_counter() - t0)
        for row, t in zip(rows, nxt):
            row.append(t)
        stage("step", i=i, seconds=steps[-1], token=nxt[0])
    return {"prefill_s": prefill_s, "steps": steps, "tokens": rows[0], "generated": sum(map(len, rows)),
            "to_eos": sum(to_eos(row, eos) for row in rows)}


def to_eos(tokens: list[int], eos: list[int]) -> int:
    """The tokens a row gives when it stops at its first EOS (the EOS counted), as spill stops."""
    return next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))


def left_padded(prompts: list[list[int]], pad: int) -> tuple[list[list[int]], list[int]]:
    """Rows of different lengths as one block, each padded on the left to the longest; and each row's padding:
    [[5, 6, 7], [8]] -> [[5, 6, 7], [pad, pad, 8]], [0, 2]."""
    n = max(map(len, prompts))
    return [[pad] * (n - len(p)) + p for p in prompts], [n - len(p) for p in prompts]


# -- llama.cpp through llama-cpp-python's low-level API, weights mmapped -----------------------------------
LLAMA_KV = {"f16": "GGML_TYPE_F16", "q8_0": "GGML_TYPE_Q8_0", "q4_0": "GGML_TYPE_Q4_0"}   # llama_cpp's constants


def llama_cpp(spec: dict) -> dict:
    import llama_cpp as L
    prompts, new, kv = spec["prompts"], spec["new"], spec.get("kv", "f16")
    b, lengths = len(prompts), [len(p) for p in prompts]
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_mmap, mp.use_mlock = True, False
    if hasattr(mp, "use_extra_bufts"):
        mp.use_extra_bufts = False   # no CPU repacking: it copies the weights into anonymous memory
    model = L.llama_model_load_from_file(spec["gguf"].encode(), mp)
    if not model:
        raise SystemExit("llama.cpp could not load the GGUF")
    cp = L.llama_context_default_params()
    per_seq = -(-(max(lengths) + new + 1) // 128) * 128   # KV cells per row (the longest's): anonymous memory
    cp.n_ctx, cp.n_seq_max = per_seq * b, b
    cp.n_batch, cp.n_ubatch = sum(lengths), min(512, sum(lengths))   # prefill in ubatches of 512: a small buffer
    cp.n_threads = cp.n_threads_batch = spec["threads"]
    cp.type_k = cp.type_v = getattr(L, LLAMA_KV[kv])
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED   # on for every KV type: a quantized V cache needs it
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit(f"llama.cpp could not make a context (KV {kv}, flash attention on)")
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(max(sum(lengths), b), 0, b)

    def decode(tokens: list[list[int]], pos: list[int]) -> list[int]:
        """One llama_decode of every row's tokens, row s's at positions pos[s]..; the rows' greedy next tokens."""
        k = 0
        for s, (toks, at) in enumerate(zip(tokens, pos)):
            for j, t in enumerate(toks):
                batch.token[k], batch.pos[k], batch.n_seq_id[k] = t, at + j, 1
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
    r = generate(lambda: decode(prompts, [0] * b),
                 lambda nxt, i: decode([[t] for t in nxt], [n + i for n in lengths]), new, spec.get("eos") or [])
    version = getattr(L, "__version__", "?") + ("" if L.llama_supports_gpu_offload() else " (CPU build)")
    L.llama_batch_free(batch)
    return {**r, "kv": kv, "flash_attn": True, "version": f"llama-cpp-python {version}"}


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
    try:
        return _hf_generate(model, spec, placed, torch, "cuda" if gpu else "cpu")
    except torch.OutOfMemoryError:
        over_cap(torch.cuda.max_memory_allocated(), cap, "(torch refused an allocation)")


def _hf_generate(model, spec: dict, placed, torch, device: str) -> dict:
    import accelerate as acc
    import transformers
    rows, pads = left_padded(spec["prompts"], spec.get("pad") or 0)
    ids = torch.tensor(rows, dtype=torch.long, device=device)
    mask = torch.tensor([[0] * p + [1] * (len(r) - p) for r, p in zip(rows, pads)], dtype=torch.long, device=device)
    state = {"mask": mask, "pos": (mask.cumsum(-1) - 1).clamp(min=0)}   # each row's positions from 0 at its start

    def forward(x, **kw) -> list[int]:
        out = model(input_ids=x, attention_mask=state["mask"], position_ids=state["pos"], use_cache=True, **kw)
        state["past"] = out.past_key_values
        return out.logits[:, -1, :].argmax(-1).tolist()

    def step(nxt: list[int], i: int) -> list[int]:
        state["mask"] = torch.cat([state["mask"], state["mask"].new_ones(len(nxt), 1)], dim=1)
        state["pos"] = state["pos"][:, -1:] + 1
        return forward(torch.tensor(nxt, device=device)[:, None], past_key_values=state["past"])

    with torch.inference_mode():   # the prefill keeps the last position's logits, as generate() does
        r = generate(lambda: forward(ids, logits_to_keep=1), step, spec["new"], spec.get("eos") or [])
    gpu_peak = torch.cuda.max_memory_allocated() if ids.is_cuda else None
    return {**r, "devices": [str(d) for d in placed], "gpu_share": spec.get("hf_gpu_share") if ids.is_cuda else None,
            "gpu_peak": gpu_peak, "version": f"transformers {transformers.__version__}, accelerate {acc.__version__}, torch {torch.__version__}"}


# -- mlx-lm with the model resident (loaded whole) ---------------------------------------------------------------
def mlx_lm(spec: dict) -> dict:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
    from mlx_lm.utils import load
    model, _ = load(spec["model"])   # not lazy: every weight in memory before the first token
    mx.eval(model.parameters())
    gpu, cap = mx.default_device() == mx.gpu, spec.get("gpu_cap")
    if gpu and cap and mx.get_peak_memory() > cap:
        over_cap(mx.get_peak_memory(), cap, "at load")
    stage("loaded")
    rows, pads = left_padded(spec["prompts"], spec.get("pad") or 0)
    cache = [BatchKVCache(pads) for _ in model.layers] if any(pads) else make_prompt_cache(model)

    def forward(x: list[list[int]]) -> list[int]:
        return mx.argmax(model(mx.array(x), cache=cache)[:, -1, :], axis=-1).tolist()

    r = generate(lambda: forward(rows), lambda nxt, i: forward([[t] for t in nxt]), spec["new"], spec.get("eos") or [])
    if gpu and cap and mx.get_peak_memory() > cap:
        over_cap(mx.get_peak_memory(), cap, "decoding")
    return {**r, "gpu_peak": mx.get_peak_memory() if gpu else None,
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
