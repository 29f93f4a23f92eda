"""A Llama-architecture causal language model in plain PyTorch.

The model follows Meta's Llama 3 architecture: pre-norm decoder blocks with RMSNorm,
grouped-query attention (``n_kv_heads <= n_heads``) through
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``, rotary position
embeddings with a configurable ``rope_theta`` (and, optionally, Llama 3.1's frequency
scaling), and a SwiGLU feed-forward network. Parameter names follow Meta's original
checkpoints (``tok_embeddings``, ``layers.{i}.attention.wq``, ``feed_forward.w1``, ...);
``hf_checkpoint.py`` maps them to and from Hugging Face's names.

Rotary embeddings use the *rotate-half* convention of Hugging Face's ``LlamaForCausalLM``
(the two halves of each head are the real and imaginary parts), not the interleaved
pairs of Meta's reference code, so Hugging Face q/k projection weights load unchanged.

Building a large model without allocating it twice::

    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("llama3-8b"))   # shapes only, no memory
    for block in model.layers:                               # optional: FSDP2 per block
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cuda")                            # allocate (uninitialised)
    model.init_weights(seed=0)                               # or load a checkpoint

``init_weights`` gives the same values sharded or not, at any world size. With tied
embeddings, leave ``tok_embeddings`` in the root FSDP group: the output projection
reads its weight after the last block.

The model holds parameters only (no buffers): rotary tables are computed in ``forward``,
so ``to_empty`` followed by ``init_weights`` or a state-dict load leaves nothing
uninitialised. Labels are aligned with the inputs (``labels[:, t]`` is the target for
position ``t``, as ``elastic_events.data.dataset.TokenDataset`` produces them); the model
does not shift them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "IGNORE_INDEX",
    "Llama",
    "LlamaConfig",
    "LlamaConfigError",
    "LlamaOutput",
    "RopeScaling",
    "TokenLoss",
    "apply_rotary_embedding",
    "rotary_tables",
    "token_cross_entropy",
]

IGNORE_INDEX = -100
"""Label value that contributes neither loss nor a token to the count."""


class LlamaConfigError(ValueError):
    """A ``LlamaConfig`` (or ``RopeScaling``) field has an invalid value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _require_positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LlamaConfigError(name, f"must be a positive number, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1 rotary frequency scaling (Hugging Face ``rope_type: "llama3"``).

    Wavelengths shorter than ``original_max_seq_len / high_freq_factor`` are kept,
    longer than ``original_max_seq_len / low_freq_factor`` are divided by ``factor``,
    and the band between is interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int

    def __post_init__(self) -> None:
        _require_positive(self, "factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len")
        if self.high_freq_factor <= self.low_freq_factor:
            raise LlamaConfigError(
                "high_freq_factor",
                f"must be greater than low_freq_factor ({self.high_freq_factor} <= {self.low_freq_factor})",
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape and numerics of a Llama model; ``LlamaConfig.from_name`` gives presets."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    hidden_dim: int
    """Width of the SwiGLU feed-forward layer (Hugging Face ``intermediate_size``)."""
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 8192
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise LlamaConfigError(name, f"must be a positive integer, got {value!r}")
        _require_positive(self, "norm_eps", "rope_theta", "init_std")
        if self.dim % self.n_heads:
            raise LlamaConfigError("dim", f"must be divisible by n_heads ({self.dim} % {self.n_heads} != 0)")
        if self.n_heads % self.n_kv_heads:
            raise LlamaConfigError(
                "n_kv_heads",
                f"must divide n_heads ({self.n_heads} % {self.n_kv_heads} != 0)",
            )
        if self.head_dim % 2:
            raise LlamaConfigError("n_heads", f"dim / n_heads must be even for rotary embeddings, got {self.head_dim}")
        if not isinstance(self.tie_embeddings, bool):
            raise LlamaConfigError("tie_embeddings", f"must be a bool, got {self.tie_embeddings!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise LlamaConfigError("rope_scaling", f"must be a RopeScaling or None, got {self.rope_scaling!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_name(cls, name: str, **overrides: object) -> LlamaConfig:
        """A named preset (see ``PRESETS``), with optional field overrides."""
        try:
            preset = PRESETS[name]
        except KeyError:
            raise LlamaConfigError("name", f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
        return dataclasses.replace(preset, **overrides)

    def num_params(self) -> int:
        """Number of parameters of ``Llama(self)``, computed from the shapes alone."""
        kv_dim = self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv_dim
        block = attention + 3 * self.dim * self.hidden_dim + 2 * self.dim
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * block + embeddings + self.dim


_LLAMA3_1_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)

PRESETS: dict[str, LlamaConfig] = {
    # ~2.9M parameters for the byte tokenizer (256 bytes + eos + pad); a micro batch of
    # 8 x 256 tokens takes well under a second per step on two CPU cores.
    "tiny": LlamaConfig(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=2,
        vocab_size=258,
        hidden_dim=704,
        rope_theta=10_000.0,
        max_seq_len=256,
        tie_embeddings=True,
    ),
    # ~0.23M parameters: the multi-process benchmarks' CI smokes, whose cost on two cores is the state every
    # step moves between 4-6 ranks, not what they check (the paths taken, the samples, the bits).
    "micro": LlamaConfig(
        dim=96,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=258,
        hidden_dim=256,
        rope_theta=10_000.0,
        max_seq_len=256,
        tie_embeddings=True,
    ),
    # Sizes between tiny and 1B for measuring what state-proportional costs (snapshots, hydration,
    # repairs) do as the state grows, on CPUs: the byte tokenizer keeps the embeddings small, so the
    # parameters sit in the blocks. fp32 training state is 16 bytes a parameter (weights, gradients,
    # AdamW's two moments); benchmarks/state_scaling.py measures what a rank holds beside it.
    "llama-25m": LlamaConfig(
        dim=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=2,
        vocab_size=258,
        hidden_dim=1536,
        rope_theta=10_000.0,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    "llama-125m": LlamaConfig(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=4,
        vocab_size=258,
        hidden_dim=3840,
        rope_theta=10_000.0,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    # The largest of these whose state fits 4 ranks (2 simulated nodes x 2) in ~20 GiB of host memory
    # with in-memory snapshots on: see benchmarks/README.md (state_scaling) for what a rank holds.
    "llama-300m": LlamaConfig(
        dim=1024,
        n_layers=20,
        n_heads=16,
        n_kv_heads=4,
        vocab_size=258,
        hidden_dim=4096,
        rope_theta=10_000.0,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    "llama3.2-1b": LlamaConfig(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128_256,
        hidden_dim=8192,
        max_seq_len=131_072,
        tie_embeddings=True,
        rope_scaling=dataclasses.replace(_LLAMA3_1_SCALING, factor=32.0),
    ),
    "llama3-8b": LlamaConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128_256,
        hidden_dim=14_336,
        max_seq_len=8192,
    ),
    "llama3.1-8b": LlamaConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128_256,
        hidden_dim=14_336,
        max_seq_len=131_072,
        rope_scaling=_LLAMA3_1_SCALING,
    ),
    "llama3-70b": LlamaConfig(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128_256,
        hidden_dim=28_672,
        max_seq_len=8192,
    ),
}


# --------------------------------------------------------------------------- rotary


def _inverse_frequencies(config: LlamaConfig, device: torch.device) -> torch.Tensor:
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64, device=device)
    inv_freq = 1.0 / (config.rope_theta ** (exponents.float() / config.head_dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_tables(
    config: LlamaConfig,
    seq_len: int,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``(seq_len, head_dim)`` for positions ``0..seq_len-1``.

    Angles are computed in float32 and cast to ``dtype`` last, as Hugging Face does.
    Each half of the last dimension holds the same ``head_dim / 2`` frequencies.
    """
    device = torch.device(device)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, _inverse_frequencies(config, device))
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(..., seq, head_dim)`` in the rotate-half convention.

    Dimension ``j`` and ``j + head_dim/2`` form one complex number rotated by the
    angle of frequency ``j``.
    """
    return x * cos + _rotate_half(x) * sin


# --------------------------------------------------------------------------- layers


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, the dtype itself for float32 and float64."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, normalising in float32 (or wider) like the reference model."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(_at_least_fp32(x.dtype))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # (batch, heads, seq, head_dim)
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary_embedding(q, cos, sin)
        k = apply_rotary_embedding(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block; the unit to wrap with FSDP2 ``fully_shard``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


# --------------------------------------------------------------------------- model


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full-size ``full`` into ``param``, or into its local shard if sharded."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor, distribute_tensor

        if isinstance(param, DTensor):
            # Every rank holds the same `full`, so slicing needs no communication.
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
            return
    param.copy_(full)


class TokenLoss(NamedTuple):
    """Summed token cross-entropy and the number of tokens it sums over."""

    loss_sum: torch.Tensor
    """float32 scalar (float64 for a float64 model): sum over tokens whose label is not ``IGNORE_INDEX``."""
    num_tokens: torch.Tensor
    """int64 scalar: how many labels are not ``IGNORE_INDEX``."""


class LlamaOutput(NamedTuple):
    logits: torch.Tensor
    """``(batch, seq, vocab)`` in the model's dtype."""
    loss: TokenLoss | None
    """Present when ``labels`` were given to ``forward``."""


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> TokenLoss:
    """Sum of float32 (float64 for a float64 model) cross-entropy over aligned ``labels`` (``IGNORE_INDEX`` skipped).

    The caller divides ``loss_sum`` by the token count of the *global* batch, so that
    the gradient is the mean over exactly that batch whatever the world size.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits {tuple(logits.shape[:-1])}")
    flat_labels = labels.reshape(-1)
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(_at_least_fp32(logits.dtype)),
        flat_labels,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return TokenLoss(loss_sum, (flat_labels != IGNORE_INDEX).sum())


class Llama(nn.Module):
    """Decoder-only Llama language model.

    ``forward(input_ids, labels=None)`` returns a ``LlamaOutput``; computing the loss
    inside ``forward`` keeps DDP and FSDP2 hooks (which wrap ``forward``) in charge.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        # Tied embeddings reuse tok_embeddings.weight in forward rather than sharing a
        # Parameter object, which `to_empty` and state-dict loading would silently untie.
        self.output = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        if self.tok_embeddings.weight.device.type != "meta":
            self.init_weights(seed=0)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministically initialise every parameter from ``seed``.

        Normal(0, init_std) for embeddings and projections, scaled by
        ``1/sqrt(2 n_layers)`` for the projections that write into the residual stream
        (``wo``, ``w2``); ones for norms. Full-size values are drawn in
        ``named_parameters`` order from one generator on the model's device, and FSDP2
        shards (DTensor parameters) keep their slice of them, so the result depends on
        ``seed``, the config and the device type only, never on how the model is sharded.
        """
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        generator = torch.Generator(device=self.tok_embeddings.weight.device)
        generator.manual_seed(seed)
        for name, param in self.named_parameters():
            # For a DTensor, shape is the global shape and device the local device.
            full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
            if name.endswith("norm.weight"):
                full.fill_(1.0)
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                full.normal_(0.0, residual_std, generator=generator)
            else:
                full.normal_(0.0, std, generator=generator)
            _copy_full_into(param, full)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> LlamaOutput:
        """Logits for ``input_ids`` of shape ``(batch, seq)``, plus the summed loss
        against aligned ``labels`` when they are given."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        seq_len = input_ids.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.config.max_seq_len}")
        h = self.tok_embeddings(input_ids)
        cos, sin = rotary_tables(self.config, seq_len, device=h.device, dtype=h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        if self.output is None:
            logits = F.linear(h, self.tok_embeddings.weight)
        else:
            logits = self.output(h)
        loss = None if labels is None else token_cross_entropy(logits, labels)
        return LlamaOutput(logits, loss)
