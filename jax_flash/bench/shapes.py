"""The shape of one benchmark row, per benchmark: its sizes, the work it does (FLOPs, bytes
read) and its label in tables and plots. A backward grid would add its shape here."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

_SHORT = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "int8": "int8",
    "float8_e4m3fn": "fp8",
}
QUANTIZED = ("int8", "float8_e4m3fn")


def short(dtype: str) -> str:
    return _SHORT.get(dtype, dtype)


def kilo(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


@dataclasses.dataclass(frozen=True)
class PrefillShape:
    batch: int
    seqlen: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    dtype: str

    @property
    def flops(self) -> float:
        f = 4.0 * self.batch * self.heads_q * self.seqlen * self.seqlen * self.head_dim
        return f / 2 if self.causal else f

    @property
    def scores_bytes(self) -> float:
        """Memory a jnp/XLA attention that materialises the scores needs (float32 scores and
        about two temporaries of their size)."""
        return 3.0 * self.batch * self.heads_q * self.seqlen * self.seqlen * 4

    def label(self) -> str:
        c = "causal" if self.causal else "full"
        return (
            f"{short(self.dtype)} B{self.batch} S{kilo(self.seqlen)} "
            f"H{self.heads_q}/{self.heads_kv} D{self.head_dim} {c}"
        )


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    batch: int
    ctx: int
    heads_q: int
    heads_kv: int
    head_dim: int
    page_size: int
    dtype: str  # of q
    cache_dtype: str  # q's dtype, or int8 / float8_e4m3fn (scaled)
    seqlen_q: int = 1
    scales: str = "token"  # quantized caches: "token" (per token and head) or "head" (per head)

    @property
    def quantized(self) -> bool:
        return self.cache_dtype in QUANTIZED

    @property
    def kv_bytes(self) -> float:
        """Bytes of K and V read: the cache elements, plus the float32 scales of a quantized
        cache with per-token scales (one per token and head, for K and for V)."""
        per_token_head = self.head_dim * jnp.dtype(self.cache_dtype).itemsize
        if self.quantized and self.scales == "token":
            per_token_head += 4
        return 2.0 * self.batch * self.ctx * self.heads_kv * per_token_head

    @property
    def gather_bytes(self) -> float:
        """Memory of the float32 dense copy of K and V the jnp gather reference makes."""
        return 2.0 * self.batch * self.ctx * self.heads_kv * self.head_dim * 4

    def label(self) -> str:
        dt = short(self.dtype)
        if self.cache_dtype != self.dtype:
            dt += "/" + short(self.cache_dtype)
        if self.quantized and self.scales == "head":
            dt += "/head"
        return (
            f"{dt} B{self.batch} ctx{kilo(self.ctx)} H{self.heads_q}/{self.heads_kv} "
            f"D{self.head_dim} p{self.page_size} Sq{self.seqlen_q}"
        )
