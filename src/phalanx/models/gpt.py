"""A small GPT (decoder-only transformer): phalanx's transformer workload.

Architecture as GPT-2 (Radford et al., 2019): learned token and position embeddings, pre-LN
blocks of causal self-attention and a GELU MLP, a final LayerNorm and a linear head. Laid out
for the parallel strategies that reuse it:

- **Tensor parallel** (Megatron-LM, Shoeybi et al., 2019): every projection is its own
  ``nn.Linear`` with a standard name (``attn.q_proj/k_proj/v_proj`` and ``mlp.fc1`` colwise,
  ``attn.out_proj`` and ``mlp.fc2`` rowwise). Attention infers its local head count from
  ``q_proj``'s output width, so a colwise-sharded block runs unchanged on its share of heads.
- **Pipeline parallel** (GPipe, Huang et al., 2019): :meth:`GPT.stages` lists modules that run
  in order, embedding -> blocks -> final norm and head, each taking one tensor.
- **Sharding / data parallel**: no tied weights by default, so stages own disjoint parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "GPTConfig", "gpt_as_sequential"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape and regularisation of a :class:`GPT`."""

    vocab_size: int
    """Number of token ids."""
    block_size: int
    """Longest sequence (context length) the position embedding covers."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int
    """Hidden width."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches."""
    bias: bool = True
    """Biases in the Linear and LayerNorm layers (the head never has one)."""
    tie_weights: bool = False
    """Share the head's weight with the token embedding (Press & Wolf, 2017). Off by default so
    that pipeline stages own disjoint parameters."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v/out projections."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c, b = config.n_embd, config.bias
        self.head_dim = c // config.n_head
        self.q_proj = nn.Linear(c, c, bias=b)
        self.k_proj = nn.Linear(c, c, bias=b)
        self.v_proj = nn.Linear(c, c, bias=b)
        self.out_proj = nn.Linear(c, c, bias=b)
        self.dropout = config.dropout
        self.resid_drop = nn.Dropout(config.dropout)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1, not n_head: under tensor parallel this rank holds only its share of the heads.
        return x.view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        b, t, _ = x.shape
        q, k, v = (
            self._heads(self.q_proj(x)),
            self._heads(self.k_proj(x)),
            self._heads(self.v_proj(x)),
        )
        p = self.dropout if self.training else 0.0
        # softmax(q k^T / sqrt(D) + causal mask) v: (B, H, T, D) @ (B, H, D, T) @ (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, -1)  # (B, T, H*D)
        return self.resid_drop(self.out_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: fc1 (C -> 4C), GELU, fc2 (4C -> C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config.n_embd
        self.fc1 = nn.Linear(c, 4 * c, bias=config.bias)
        # Exact (erf) GELU rather than GPT-2's tanh approximation: ~25% cheaper on CPU.
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * c, c, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """First pipeline stage: token ids (B, T) -> hidden states (B, T, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.block_size = config.block_size
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) int64 -> (B, T, C)."""
        if idx.dim() != 2:
            raise ValueError(f"GPT: idx must be (batch, time), got shape {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"GPT: sequence length {t} exceeds block_size={self.block_size}")
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))


class LMHead(nn.Module):
    """Last pipeline stage: hidden states (B, T, C) -> logits (B, T, V) via ``ln_f`` and ``head``.

    Holds the model's own ``ln_f`` and ``head`` modules (shared, not copied).
    """

    def __init__(self, ln_f: nn.LayerNorm, head: nn.Linear) -> None:
        super().__init__()
        self.ln_f = ln_f
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, V)."""
        return self.head(self.ln_f(x))  # (B, T, C) @ (C, V)


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Submodules: ``embed`` (``tok_emb``, ``pos_emb``), ``blocks`` (``nn.ModuleList`` of
    :class:`Block`), ``ln_f``, ``head``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(_init_weights)
        # GPT-2: scale the init of the projections that write into the residual stream by
        # 1/sqrt(2 * n_layer), since each block adds two such branches to it.
        std = 0.02 / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            assert isinstance(block, Block)
            nn.init.normal_(block.attn.out_proj.weight, mean=0.0, std=std)
            nn.init.normal_(block.mlp.fc2.weight, mean=0.0, std=std)
        if config.tie_weights:
            self.head.weight = self.embed.tok_emb.weight

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) for token ids (B, T), and the mean cross-entropy if ``targets``."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, C) @ (C, V)
        if targets is None:
            return logits, None
        if logits.shape[-1] != self.config.vocab_size:  # a tensor-parallel vocabulary shard
            raise ValueError(
                f"GPT: the head returns {logits.shape[-1]} of vocab_size="
                f"{self.config.vocab_size} logits (tensor-parallel vocabulary shard); compute "
                f"the loss with phalanx.tensor_parallel.gpt_loss(model, idx, targets)"
            )
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def stages(self) -> list[nn.Module]:
        """Modules that, applied in order to ``idx``, compute ``self(idx)[0]``.

        ``[embed, block_0, ..., block_{n-1}, LMHead(ln_f, head)]``; they share this model's
        parameters. A pipeline splits this list into contiguous runs, one per stage.
        """
        return [self.embed, *self.blocks, LMHead(self.ln_f, self.head)]

    def num_parameters(self) -> int:
        """Number of distinct parameter elements (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T); returns (B, T + new).

        Args:
            idx: Prompt token ids (B, T).
            max_new_tokens: Tokens to sample.
            temperature: Divides the logits; lower is greedier.
            top_k: Sample only among the ``top_k`` most likely tokens.
            generator: Source of randomness; the same seed gives the same text.

        Call ``model.eval()`` first when the model has dropout.
        """
        if max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature <= 0:
            raise ValueError(f"generate: temperature must be > 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"generate: top_k must be >= 1 or None, got {top_k}")
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits = self(context)[0][:, -1, :] / temperature  # (B, V)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def gpt_as_sequential(model: GPT) -> nn.Sequential:
    """``nn.Sequential(*model.stages())``: token ids (B, T) in, logits (B, T, V) out."""
    return nn.Sequential(*model.stages())


def _init_weights(module: nn.Module) -> None:
    # GPT-2: N(0, 0.02) for every weight matrix and embedding, zero biases.
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
