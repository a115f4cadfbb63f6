"""Write a small random-weight Llama checkpoint in Hugging Face format, with transformers itself.

    python examples/make_tiny_checkpoint.py DIR [--model-type llama|qwen2|mistral]
    python examples/generate.py --checkpoint DIR --prompt "the cat sat on"

DIR gets config.json, sharded *.safetensors with model.safetensors.index.json (written by
transformers' save_pretrained) and a word-level tokenizer.json (written by the tokenizers
library), so the checkpoint path of examples/generate.py can be tried without a download. Needs
`transformers` and `torch` (CPU is enough); the text it generates is random words.
"""

from __future__ import annotations

import argparse

WORDS = (
    "the a cat dog sat on mat ran to house garden and with big small red blue quickly slowly "
    "jumps over under lazy fox river tree sun moon night day"
).split()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output directory")
    parser.add_argument("--model-type", choices=["llama", "qwen2", "mistral"], default="llama")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()

    common = dict(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }[args.model_type](**common)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(args.out, safe_serialization=True, max_shard_size="200KB")
    tokenizer.save(f"{args.out}/tokenizer.json")
    print(f"wrote {args.model_type} checkpoint ({model.num_parameters()} parameters) to {args.out}")


if __name__ == "__main__":
    main()
