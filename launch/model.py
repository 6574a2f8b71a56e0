"""A small GPT-style byte-level causal language model, in plain torch.

The model is deliberately tiny (about 1.9 M parameters at the defaults) so the
demonstration job trains quickly on CPU, while still having enough structure
(per-block modules, dropout RNG, tied weights) to exercise checkpointing of
FSDP2-sharded state and exact resume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "num_parameters", "lr_lambda_warmup_cosine"]


@dataclass(kw_only=True)
class GPTConfig:
    """Hyperparameters of :class:`GPT`.

    Attributes:
        vocab_size: Number of token ids (256 for raw bytes).
        seq_len: Maximum sequence length (size of the learned position table).
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block; must divide ``d_model``.
        d_model: Residual stream width.
        dropout: Dropout probability on embeddings, attention and residual
            branches. Non-zero by default so the RNG state matters for
            exact-resume tests.
    """

    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 192
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention using ``scaled_dot_product_attention``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend causally.

        Args:
            x: float tensor ``[B, T, C]``.

        Returns:
            float tensor ``[B, T, C]``.
        """
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # [B, T, C] -> [B, H, T, C/H]
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x expansion with GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x: float ``[B, T, C]``. Returns: float ``[B, T, C]``."""
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x: float ``[B, T, C]``. Returns: float ``[B, T, C]``."""
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """Byte-level GPT: token + learned position embeddings, pre-LN blocks, tied LM head.

    The LM head shares its weight with the token embedding. With FSDP2, apply
    ``fully_shard`` to each element of :attr:`blocks` and then to the root
    module: both tied uses live in the root's parameter group, so the tie
    survives sharding.

    Attributes:
        cfg: The :class:`GPTConfig` used to build the model.
        blocks: ``nn.ModuleList`` of transformer blocks (shard these individually).
    """

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg if cfg is not None else GPTConfig()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style init; deterministic given torch.manual_seed since modules are
        # visited in a fixed order. Small std keeps initial logits near zero so the
        # initial loss is close to ln(vocab_size).
        std = 0.02
        resid_std = std / math.sqrt(2 * self.cfg.n_layer)  # residual projections scaled by depth
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:  # LayerNorm weights
                nn.init.ones_(p)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=resid_std)
            else:
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute next-token logits and, optionally, the loss.

        Args:
            idx: int64 token ids ``[B, T]`` with ``T <= cfg.seq_len``.
            targets: int64 next-token ids ``[B, T]``, or ``None``.

        Returns:
            ``(logits, loss)``: logits are float ``[B, T, vocab_size]``; loss is a
            float scalar (mean cross entropy over all ``B*T`` positions) or
            ``None`` when ``targets`` is ``None``.
        """
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds cfg.seq_len={self.cfg.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(B * T, -1).float(), targets.reshape(B * T))
        return logits, loss


def num_parameters(model: nn.Module) -> int:
    """Count unique parameters (tied weights counted once).

    Args:
        model: Any module.

    Returns:
        Total number of scalar parameters; ``model.parameters()`` already
        de-duplicates shared tensors. For FSDP2-sharded models this counts the
        local shard sizes unless parameters are full tensors.
    """
    return sum(p.numel() for p in model.parameters())


def lr_lambda_warmup_cosine(
    warmup_steps: int, total_steps: int, min_ratio: float = 0.1
) -> Callable[[int], float]:
    """Learning-rate multiplier: linear warmup, then cosine decay to ``min_ratio``.

    Intended for ``torch.optim.lr_scheduler.LambdaLR``. The multiplier is
    ``step / warmup_steps`` for ``step < warmup_steps`` (so 0 at step 0), 1.0 at
    ``step == warmup_steps``, then follows a half cosine down to ``min_ratio`` at
    ``step == total_steps`` and stays there afterwards.

    Args:
        warmup_steps: Number of warmup steps (``>= 0``).
        total_steps: Step at which the decay reaches ``min_ratio`` (``>= warmup_steps``).
        min_ratio: Final multiplier, in ``[0, 1]``.

    Returns:
        A pure function ``step -> float``. It holds no state, so LambdaLR's
        state_dict (which skips the lambda) still resumes exactly.
    """
    if warmup_steps < 0 or total_steps < warmup_steps:
        raise ValueError(f"need 0 <= warmup_steps <= total_steps, got {warmup_steps}, {total_steps}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")

    def fn(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        if step >= total_steps:
            return min_ratio
        progress = (step - warmup_steps) / (total_steps - warmup_steps)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn
