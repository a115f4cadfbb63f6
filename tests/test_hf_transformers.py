"""Parity with Hugging Face `transformers` itself: a checkpoint written by transformers'
`save_pretrained` (random weights, float32) loads through `load_hf_checkpoint` and gives the same
logits, and greedy generation the same tokens, as transformers' own model.

Runs where `transformers` and `torch` are installed (they are not dependencies of jax_flash);
skipped otherwise. Llama (GQA, Llama 3 RoPE scaling, sharded safetensors), Qwen2 (q/k/v biases,
tied embeddings) and Mistral (sliding window shorter than the prompt).
"""

import numpy as np
import pytest

pytest.importorskip("flax.nnx")
pytest.importorskip("safetensors")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from jax_flash.models import generate, load_hf_checkpoint  # noqa: E402

COMMON = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

CASES = {
    "llama": lambda: transformers.LlamaConfig(
        **COMMON,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=7),
}


def _hf_model(name, tmp_path):
    torch.manual_seed(0)
    config = CASES[name]()
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Norm weights and biases start as constants; random values test that they are used.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.eval()
    # A small shard size writes several files and a model.safetensors.index.json.
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    return model


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_tokens_match_transformers(tmp_path, name):
    hf = _hf_model(name, tmp_path)
    if name == "llama":
        assert (tmp_path / "model.safetensors.index.json").exists()
    model, config = load_hf_checkpoint(str(tmp_path), dtype=jnp.float32)
    assert config.num_key_value_heads == 2

    rng = np.random.default_rng(0)
    ids = rng.integers(3, COMMON["vocab_size"], 19).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].double().numpy()

    # Prefill logits of every prompt position through the packed-prefill path.
    cache = model.init_cache(8, 4, jnp.arange(8, dtype=jnp.int32)[None, :])
    tokens = jnp.asarray(ids, jnp.int32)
    cu = jnp.asarray([0, len(ids)], jnp.int32)
    logits, _ = model.prefill(cache, tokens, cu, all_logits=True)
    logits = np.asarray(logits, np.float64)
    err = np.linalg.norm(logits - expected) / np.linalg.norm(expected)
    assert err < 1e-5, err

    # Greedy continuation (prefill, then paged decode steps) equals transformers' greedy.
    new = 9
    with torch.no_grad():
        hf_out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            num_beams=1,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    out = generate(model, [ids], new, eos_token_id=None, page_size=4)
    assert out.tokens[0] == hf_out
