"""The peers table: a peer past its GPU cap is shown but never the best peer; tables live between their markers."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("peers_report", ROOT / "benchmarks" / "peers_report.py")
peers_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peers_report)

HEAD = {"time": "t", "machine": "m", "cap": 2**32, "gpu_cap": 2**32, "model": "llama", "model_bytes": 6e9,
        "prompt": 64, "new": 16, "cold_gbps_before": 2.0}


def test_a_peer_over_its_gpu_cap_is_listed_but_not_the_best():
    runs = [HEAD,
            {"peer": "spill", "batch": 33, "status": "ok", "s_per_step": 4.0, "decode_tps": 8.0, "gpu_peak": 2**30,
             "gpu_used_peak": 1536 * 2**20},
            {"peer": "mlx-lm", "batch": 1, "status": "over the GPU cap", "last_stage": None, "gpu_peak": 6 * 2**30},
            {"peer": "accelerate", "batch": 64, "status": "over the GPU cap", "last_stage": "step", "s_per_step": 1.0,
             "decode_tps": 64.0, "steps": [1.0]},
            {"peer": "llama.cpp", "batch": 64, "status": "ok", "s_per_step": 5.0, "decode_tps": 12.0},
            {"run": "peers-end", "cold_gbps_after": 2.0}]
    lines = peers_report.table(runs)
    assert "GPU memory capped at 4.00 GiB" in lines[0]
    assert any(x.startswith("| mlx-lm | 1 | over the GPU cap at load |") and "| 6144 | - |" in x for x in lines)
    assert any(x.startswith("| spill | 33 |") and "| 1024 | 1536 |" in x for x in lines)   # arrays, then the device's
    assert lines[-1].startswith("Best peer: llama.cpp at batch 64, 12.0 tok/s")
    assert "0.67x the best peer" in lines[-1]


def test_each_table_replaces_only_what_is_between_its_own_markers(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# B\n\n<!-- peers:begin -->\nold VM\n<!-- peers:end -->\nafter\n")
    peers_report.write_doc(doc, ["gpu table"], "peers-gpu")
    peers_report.write_doc(doc, ["new VM"])
    text = doc.read_text()
    assert "new VM" in text and "old VM" not in text and "after" in text
    assert "<!-- peers-gpu:begin -->\ngpu table\n<!-- peers-gpu:end -->" in text


def test_spill_past_the_gpu_cap_gets_no_figure():
    runs = [HEAD, {"peer": "spill", "batch": 90, "status": "over the GPU cap", "s_per_step": 4.0, "decode_tps": 22.0,
                   "gpu_peak": 5 * 2**30},
            {"peer": "llama.cpp", "batch": 64, "status": "ok", "s_per_step": 5.0, "decode_tps": 12.0},
            {"run": "peers-end", "cold_gbps_after": 2.0}]
    assert peers_report.table(runs)[-1].endswith("spill held 5.00 GiB on the GPU, over the cap: no figure.")


def test_spills_row_0_is_compared_by_the_text_of_the_reference_tokens_and_its_rate_shown_both_ways():
    pieces = {1: "ab", 2: "c", 3: "d", 4: "x"}
    decode = lambda ids: "".join(pieces[i] for i in ids)   # noqa: E731
    assert peers_report.text_agreement("abcd", [1, 2, 3], decode) == "3/3"
    assert peers_report.text_agreement("abcx", [1, 2, 3], decode) == "first 2/3"
    assert peers_report.text_agreement("", [1, 2, 3], decode) == "first 0/3"
    assert peers_report.text_agreement(None, [1], decode) == "-"
    runs = [HEAD, {"peer": "spill", "batch": 8, "status": "ok", "s_per_step": 1.0, "decode_tps": 8.0, "agree": "first 2/3",
                   "decode_tps_all": 5.0},
            {"peer": "accelerate", "batch": 8, "status": "ok", "s_per_step": 1.0, "decode_tps": 8.0, "tokens": [1, 2, 3]},
            {"run": "peers-end", "cold_gbps_after": 2.0}]
    lines = peers_report.table(runs)
    assert any(x.startswith("| spill | 8 | ok | 1.00 | 8.0 (5.0 every pass) |") and x.endswith("| first 2/3 |")
               for x in lines)
    assert lines[-1].endswith("spill: 8.0 tok/s at batch 8, 1.00x the best peer (goal: >= 2x).")


def test_a_peer_refused_past_its_gpu_cap_in_prefill_reads_in_prefill_not_at_load():
    """accelerate's child says "loaded", then "over-cap" as torch refuses its prefill's allocation: the table said
    "at load" (the refusal's own stage hid how far it got)."""
    err = "\n".join(['{"stage": "loaded", "t": 1}', "Some parameters are on the meta device",
                     '{"stage": "over-cap", "t": 2, "gpu_peak": 3003315712, "when": "(torch refused an allocation)"}',
                     "GPU memory 2.80 GiB (torch refused an allocation), over the cap of 3.00 GiB"])
    facts = peers_report.child_stages(err)
    assert facts["last_stage"] == "loaded" and len(facts["stages"]) == 2 and len(facts["stderr_tail"]) == 2
    runs = [HEAD, {"peer": "accelerate", "batch": 192, "status": "over the GPU cap", "gpu_peak": 3003315712, **facts},
            {"run": "peers-end", "cold_gbps_after": 2.0}]
    assert any(x.startswith("| accelerate | 192 | over the GPU cap in prefill |") for x in peers_report.table(runs))


def test_accelerates_runs_at_each_share_of_the_gpu_cap_in_weights_are_told_apart():
    runs = [HEAD, {"peer": "spill", "batch": 185, "status": "ok", "s_per_step": 3.0, "decode_tps": 60.0},
            {"peer": "accelerate", "batch": 128, "status": "ok", "s_per_step": 3.0, "decode_tps": 41.0, "gpu_share": 0.5},
            {"peer": "accelerate", "batch": 192, "status": "ok", "s_per_step": 3.6, "decode_tps": 50.0, "gpu_share": 0.25},
            {"run": "peers-end", "cold_gbps_after": 2.0}]
    lines = peers_report.table(runs)
    assert any(x.startswith("| accelerate (weights 0.25 of the GPU cap) | 192 | ok |") for x in lines)
    assert any(x.startswith("| accelerate (weights 0.50 of the GPU cap) | 128 | ok |") for x in lines)
    assert "Best peer: accelerate at batch 192, weights 0.25 of the GPU cap, 50.0 tok/s" in lines[-1]


def test_real_prompts_several_spill_configurations_and_llamas_kv_types_are_named_in_the_table():
    head = {**HEAD, "prompt": "56-1134 tokens (median 128)", "tiers": "document,edit", "rows": 32, "new": 64}
    head.pop("gpu_cap")
    runs = [head,
            {"peer": "spill", "batch": 32, "status": "ok", "s_per_step": 0.5, "decode_tps": 60.0, "args": "--speculate off",
             "kv": "compute dtype", "completion_tokens": 1500, "text0": "x", "agree": "20/20", "drafted": 0},
            {"peer": "spill", "batch": 32, "status": "ok", "s_per_step": 0.5, "decode_tps": 90.0,
             "args": "--speculate auto --kv-bits 8 --kv-group-size 32", "kv": "8-bit (group 32)",
             "completion_tokens": 1490, "drafted": 400, "accepted": 150},
            {"peer": "llama.cpp", "batch": 32, "status": "ok", "s_per_step": 0.4, "decode_tps": 80.0, "kv": "f16",
             "tokens": [1, 2], "generated": 2048, "to_eos": 1500},
            {"peer": "llama.cpp", "batch": 32, "status": "oom-killed", "last_stage": "loaded", "kv": "q8_0"},
            {"run": "peers-end", "cold_gbps_after": 2.0}]
    lines = peers_report.table(runs)
    assert "32 real prompts of the document,edit tiers, 56-1134 tokens (median 128), max_tokens 64" in lines[0]
    assert lines[3].endswith("| row 0 tokens = llama.cpp (KV f16)'s |")
    assert any(x.startswith("| spill (--speculate off) | 32 | ok | 0.50 | 60.0 | 1500 |") and x.endswith("| 20/20 |")
               for x in lines)
    assert any(x.startswith("| spill (--speculate auto --kv-bits 8 --kv-group-size 32) | 32 | ok |") for x in lines)
    assert any(x.startswith("| llama.cpp (KV f16) | 32 | ok | 0.40 | 80.0 | 2048 (1500 to EOS) |")
               and x.endswith("| reference |") for x in lines)
    assert any(x.startswith("| llama.cpp (KV q8_0) | 32 | oom-killed in prefill |") for x in lines)
    assert any(x.startswith("No batched speculation in the peers, so none is used here: llama.cpp: ") for x in lines)
    assert "Drafts: spill (--speculate auto --kv-bits 8 --kv-group-size 32): 150 of 400 drafts accepted." in lines
    assert lines[-1] == ("Best peer: llama.cpp (KV f16) at batch 32, 80.0 tok/s (ok). "
                         "spill (--speculate off): 60.0 tok/s at batch 32, 0.75x the best peer (goal: >= 2x). "
                         "spill (--speculate auto --kv-bits 8 --kv-group-size 32): 90.0 tok/s at batch 32, "
                         "1.12x the best peer (goal: >= 2x).")
