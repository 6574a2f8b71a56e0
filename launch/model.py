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

__all__ = [
    "GPTConfig",
    "GPT",
    "SampleDropout",
    "SampleSeedStream",
    "per_sample_keep_mask",
    "num_parameters",
    "lr_lambda_warmup_cosine",
]


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
        attn_dropout: Dropout probability inside attention (on the attention
            weights); ``None`` means ``dropout``. It always draws from the
            global torch RNG, so per-sample dropout (``sample_seeds``) needs 0.
    """

    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 192
    dropout: float = 0.1
    attn_dropout: float | None = None

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.attn_dropout is not None and not 0.0 <= self.attn_dropout < 1.0:
            raise ValueError(f"attn_dropout must be in [0, 1) or None, got {self.attn_dropout}")

    @property
    def effective_attn_dropout(self) -> float:
        """Attention-weight dropout actually used: ``attn_dropout``, else ``dropout``."""
        return self.dropout if self.attn_dropout is None else self.attn_dropout


@torch.compiler.disable  # Generator seeding is Python-level work; keep it out of compiled graphs.
def per_sample_keep_mask(
    sample_seeds: torch.Tensor,
    site: int,
    shape: tuple[int, ...],
    p: float,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inverted-dropout multipliers drawn from one generator per ``(sample seed, site)``.

    The mask of a sample depends only on its seed and the dropout site, never on
    which rank or micro-batch the sample lands on, so a training step computes
    the same function of the global batch at any world size.

    Args:
        sample_seeds: int64 ``[B]`` (any device), one seed per sample.
        site: Index of the dropout module in the model (distinct per module).
        shape: Per-sample shape of the activation (e.g. ``(T, C)``).
        p: Drop probability in ``[0, 1)``.
        device: Device of the activation; the generator runs there.
        dtype: Dtype of the returned multipliers.

    Returns:
        ``[B, *shape]`` tensor of ``0`` or ``1 / (1 - p)``.
    """
    masks = []
    for seed in sample_seeds.tolist():
        g = torch.Generator(device=device)
        g.manual_seed((int(seed) * 1_000_003 + site) % 2**63)
        masks.append(torch.rand(shape, generator=g, device=device) >= p)
    return torch.stack(masks).to(dtype) / (1.0 - p)


class SampleDropout(nn.Dropout):
    """``nn.Dropout`` that can take its mask from per-sample seeds instead of the torch RNG.

    Without ``sample_seeds`` (or in eval mode) it is exactly ``nn.Dropout``.

    Args:
        p: Drop probability.
        site: Distinct index of this module within the model; mixed into each
            sample's seed so different layers draw different masks.
    """

    def __init__(self, p: float, site: int) -> None:
        super().__init__(p)
        self.site = site

    def forward(self, x: torch.Tensor, sample_seeds: torch.Tensor | None = None) -> torch.Tensor:
        """Args: x: float ``[B, ...]``; sample_seeds: int64 ``[B]`` or ``None``.

        Returns: ``x`` with dropout applied, same shape and dtype.
        """
        if sample_seeds is None or not self.training or self.p == 0.0:
            return super().forward(x)
        if sample_seeds.shape != (x.shape[0],):
            raise ValueError(f"sample_seeds must have shape [{x.shape[0]}], got {list(sample_seeds.shape)}")
        mask = per_sample_keep_mask(sample_seeds, self.site, tuple(x.shape[1:]), self.p, device=x.device, dtype=x.dtype)
        return x * mask


class SampleSeedStream:
    """The per-sample dropout seeds of every step, from one generator shared by all ranks.

    Every rank holds an identical stream and draws the seeds of the whole global
    batch each step, then keeps its own slice, so sample ``j`` of global batch
    ``k`` gets the same seed at any world size. Its state goes into checkpoints
    (``state_dict``/``load_state_dict``) so a resumed run draws the same seeds.

    Args:
        seed: Base seed, identical on every rank.
    """

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def draw(self, global_batch_size: int, *, rank: int = 0, world_size: int = 1) -> torch.Tensor:
        """Draw the seeds of one global batch; return this rank's slice.

        Args:
            global_batch_size: ``G``; all ranks must pass the same value.
            rank: This rank; it gets ``seeds[rank * G/W : (rank + 1) * G/W]``.
            world_size: ``W``, dividing ``G``.

        Returns:
            int64 CPU tensor ``[G // W]``.
        """
        seeds = torch.randint(0, 2**62, (global_batch_size,), generator=self.generator)
        b = global_batch_size // world_size
        return seeds[rank * b : (rank + 1) * b]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"generator": uint8 tensor}`` (the CPU generator state)."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Restore a :meth:`state_dict`."""
        self.generator.set_state(state_dict["generator"])


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention using ``scaled_dot_product_attention``."""

    def __init__(self, cfg: GPTConfig, site: int = 0) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.effective_attn_dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = SampleDropout(cfg.dropout, site)

    def forward(self, x: torch.Tensor, sample_seeds: torch.Tensor | None = None) -> torch.Tensor:
        """Attend causally.

        Args:
            x: float tensor ``[B, T, C]``.
            sample_seeds: int64 ``[B]`` for per-sample residual dropout, or ``None``.

        Returns:
            float tensor ``[B, T, C]``.
        """
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # [B, T, C] -> [B, H, T, C/H]
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y), sample_seeds)


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x expansion with GELU."""

    def __init__(self, cfg: GPTConfig, site: int = 0) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = SampleDropout(cfg.dropout, site)

    def forward(self, x: torch.Tensor, sample_seeds: torch.Tensor | None = None) -> torch.Tensor:
        """Args: x: float ``[B, T, C]``; sample_seeds: int64 ``[B]`` or ``None``.

        Returns: float ``[B, T, C]``.
        """
        return self.drop(self.proj(F.gelu(self.fc(x))), sample_seeds)


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig, index: int = 0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        # Dropout sites: 0 is the embedding dropout, then two per block.
        self.attn = CausalSelfAttention(cfg, site=1 + 2 * index)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg, site=2 + 2 * index)

    def forward(self, x: torch.Tensor, sample_seeds: torch.Tensor | None = None) -> torch.Tensor:
        """Args: x: float ``[B, T, C]``; sample_seeds: int64 ``[B]`` or ``None``.

        Returns: float ``[B, T, C]``.
        """
        x = x + self.attn(self.ln1(x), sample_seeds)
        x = x + self.mlp(self.ln2(x), sample_seeds)
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
        self.drop = SampleDropout(cfg.dropout, site=0)
        self.blocks = nn.ModuleList(Block(cfg, index=i) for i in range(cfg.n_layer))
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
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        sample_seeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute next-token logits and, optionally, the loss.

        Args:
            idx: int64 token ids ``[B, T]`` with ``T <= cfg.seq_len``.
            targets: int64 next-token ids ``[B, T]``, or ``None``.
            sample_seeds: int64 ``[B]``: draw each sample's dropout masks from its
                own seed (see :class:`SampleDropout`), so the result does not
                depend on how the global batch is split over ranks. ``None``
                uses ordinary dropout (the global torch RNG).

        Returns:
            ``(logits, loss)``: logits are float ``[B, T, vocab_size]``; loss is a
            float scalar (mean cross entropy over all ``B*T`` positions) or
            ``None`` when ``targets`` is ``None``.

        Raises:
            ValueError: ``T > cfg.seq_len``, or ``sample_seeds`` in training mode
                with a non-zero attention dropout (which would use the torch RNG).
        """
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds cfg.seq_len={self.cfg.seq_len}")
        if sample_seeds is not None and self.training and self.cfg.effective_attn_dropout > 0:
            raise ValueError(
                f"sample_seeds needs GPTConfig.attn_dropout=0 (it is {self.cfg.effective_attn_dropout}): "
                "attention-weight dropout draws from the torch RNG, not from per-sample seeds"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos), sample_seeds)
        for block in self.blocks:
            x = block(x, sample_seeds)
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


def lr_lambda_warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> Callable[[int], float]:
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
