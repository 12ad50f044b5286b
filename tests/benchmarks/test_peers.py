"""peers.py's own bookkeeping: a peer that failed keeps the setting it ran with; what runs, on which rows."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("peers", ROOT / "benchmarks" / "peers.py")
peers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peers)


def test_accelerate_over_its_gpu_cap_keeps_the_share_it_ran_with(tmp_path, monkeypatch):
    # a child refused past the cap reports no share of its own: the table showed such a row unlabelled
    died = {"status": "failed", "rc": peers.OVER_CAP, "oom_kills": 0, "cgroup_peak": 1, "wall_s": 2.0, "stdout": "",
            "stages": [{"stage": "over-cap", "gpu_peak": 3 << 30}], "last_stage": "loaded"}
    monkeypatch.setattr(peers, "capped", lambda *a, **k: dict(died))
    r = peers.run_peer(SimpleNamespace(work=str(tmp_path)), "accelerate", 2, {"prompts": [[1], [2]], "hf_gpu_share": 0.5},
                       [])
    assert r["status"] == "over the GPU cap" and r["gpu_share"] == 0.5


def test_llama_cpp_killed_at_its_cap_keeps_the_kv_cache_type_it_ran_with(tmp_path, monkeypatch):
    died = {"status": "oom-killed", "rc": -9, "oom_kills": 1, "cgroup_peak": 1, "wall_s": 2.0, "stdout": "",
            "stages": [{"stage": "loaded"}], "last_stage": "loaded"}
    monkeypatch.setattr(peers, "capped", lambda *a, **k: dict(died))
    r = peers.run_peer(SimpleNamespace(work=str(tmp_path)), "llama.cpp", 2, {"prompts": [[1], [2, 3]], "kv": "q8_0"}, [])
    assert (r["status"], r["kv"]) == ("oom-killed", "q8_0")


def test_each_spill_configuration_and_each_llama_kv_type_is_a_run_of_its_own():
    a = peers.parse(["--model", "m", "--tier", "document,edit", "--peers", "spill,llama.cpp", "--batches", "16,32,64",
                     "--spill-args=--stream", "--spill-configs", "off;--speculate auto --kv-bits 8",
                     "--llama-kv", "f16,q8_0", "--spill-cap", "2GiB"])
    steps = peers.plan(a, 32, gpu=False)
    spill = [(s["args"], s.get("cap")) for s in steps if s["peer"] == "spill"]
    assert spill == [(["--stream", "--speculate", "off"], None), (["--stream", "--speculate", "auto", "--kv-bits", "8"], None),
                     (["--stream", "--speculate", "off"], "2GiB"),
                     (["--stream", "--speculate", "auto", "--kv-bits", "8"], "2GiB")]
    assert all(s["batch"] == 32 for s in steps if s["peer"] == "spill")   # no more rows than the tiers have
    llama = [(s["kv"], s["batch"]) for s in steps if s["peer"] == "llama.cpp"]
    assert llama == [("f16", 16), ("f16", 32), ("q8_0", 16), ("q8_0", 32)]   # 64 is clipped to the 32 rows there are
    assert [s["peer"] for s in steps][:4] == ["spill"] * 4


def test_a_peer_not_known_is_refused_by_name(capsys):
    import pytest
    with pytest.raises(SystemExit):
        peers.parse(["--peers", "spill,llamacpp"])
    assert "--peers llamacpp: the peers are spill,llama.cpp,accelerate,mlx-lm" in capsys.readouterr().err


def test_real_prompts_give_spill_and_every_peer_the_same_ids_each_of_its_own_length(make_tiny, tmp_path):
    folder = make_tiny("llama")
    a = peers.parse(["--model", str(folder), "--tier", "edit", "--rows", "20", "--new", "48", "--work", str(tmp_path)])
    lines, ids, head = peers.rows_and_ids(a, folder)
    assert len(lines) == len(ids) == 20 and len({len(x) for x in ids}) > 5   # rows 16.. repeat rows 0..
    assert ids[16] == ids[0] and [x["custom_id"] for x in lines[:2]] == ["r0", "r1"]
    assert all(x["body"]["max_tokens"] == 48 and x["body"]["temperature"] == 0 for x in lines)
    from spill.tokenizer_worker.core import TokenizerCore
    tok = TokenizerCore(folder).tokenizer
    assert ids[3] == list(tok.apply_chat_template(lines[3]["body"]["messages"], add_generation_prompt=True))
    assert head["tiers"] == "edit" and head["rows"] == 20 and head["prompt"].endswith(f"(median {sorted(map(len, ids))[10]})")
