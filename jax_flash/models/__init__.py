"""Decoders built on jax_flash: a Llama-family model, a Hugging Face checkpoint loader and
batched generation with a paged KV cache."""

from .generation import GenerateOutput, generate
from .llama import (
    LlamaConfig,
    LlamaForCausalLM,
    hf_parameters,
    load_hf_checkpoint,
    load_tokenizer,
)

__all__ = [
    "GenerateOutput",
    "LlamaConfig",
    "LlamaForCausalLM",
    "generate",
    "hf_parameters",
    "load_hf_checkpoint",
    "load_tokenizer",
]
