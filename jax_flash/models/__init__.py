"""Decoders built on jax_flash: a Llama-family model, a Hugging Face checkpoint loader and
batched generation with a paged KV cache, tensor-parallel over a mesh with `shard_model`, and
the next-token loss of training (`next_token_loss`, `pack_sequences`)."""

from .generation import GenerateOutput, generate
from .llama import (
    HFTensor,
    LlamaConfig,
    LlamaForCausalLM,
    hf_parameters,
    hf_state_dict,
    load_hf_checkpoint,
    load_tokenizer,
)
from .sharding import shard_model
from .training import next_token_loss, next_token_targets, pack_sequences

__all__ = [
    "GenerateOutput",
    "HFTensor",
    "LlamaConfig",
    "LlamaForCausalLM",
    "generate",
    "hf_parameters",
    "hf_state_dict",
    "load_hf_checkpoint",
    "load_tokenizer",
    "next_token_loss",
    "next_token_targets",
    "pack_sequences",
    "shard_model",
]
