"""Transformer building blocks shared by the ViT, the MAE decoder, the captioner and CLIP.

DP constraint that shapes this file: a per-sample-gradient engine hooks leaf modules, so every
trainable parameter must live in a layer with a clipping rule (pipeline/privacy/layer_rules.py):

* ``nn.Linear``, ``nn.LayerNorm``, ``nn.Embedding`` (standard per-sample gradient rules), and
* ``BroadcastParameter`` subclasses (cls token, mask token, log temperature).  Their forward
  takes only a batch size and returns the parameter broadcast to ``(B, *param.shape)``.  Hence
  the gradient w.r.t. that output *is* the per-sample gradient of the parameter; an engine needs
  no activation for them (``grad_sample = grad_output``).

No Conv, BatchNorm (mixes samples) or nn.MultiheadAttention (owns raw parameters) anywhere.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class BroadcastParameter(nn.Module):
    """A leaf module owning exactly one parameter, returned broadcast over the batch.

    ``forward(like)`` returns a view of shape ``(like.shape[0], *shape)``; callers expand it
    further (e.g. one mask token to many positions) *outside* the module, so autograd sums
    those copies before the gradient reaches this module's output.
    """

    def __init__(self, *shape: int, init_value: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))
        self.init_value = init_value
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.init_value is None:
            nn.init.normal_(self.weight, std=0.02)  # as for MAE's cls/mask tokens
        else:
            nn.init.constant_(self.weight, self.init_value)

    def forward(self, like: torch.Tensor | int) -> torch.Tensor:
        """The parameter broadcast over the batch of `like` (a tensor whose first dim is the batch).

        A tensor rather than a bare int so that hook-based engines (ours, Opacus) see an ordinary
        batched input."""
        batch_size = like if isinstance(like, int) else like.shape[0]
        return self.weight.unsqueeze(0).expand(batch_size, *self.weight.shape)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.weight.shape)}"


class ClassToken(BroadcastParameter):
    """Learned [cls] token of the ViT: forward(x) -> (x.shape[0], 1, dim)."""

    def __init__(self, dim: int):
        super().__init__(1, dim)


class MaskToken(BroadcastParameter):
    """Learned MAE mask token: forward(x) -> (x.shape[0], 1, dim)."""

    def __init__(self, dim: int):
        super().__init__(1, dim)


class LogitScale(BroadcastParameter):
    """CLIP's learned log inverse temperature: forward(x) -> (x.shape[0],), initialised to log(1/0.07)."""

    def __init__(self, init_temperature: float = 0.07):
        super().__init__(init_value=math.log(1.0 / init_temperature))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Multi-head attention on (B, heads, L, head_dim) tensors."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv nn.Linear and an output nn.Linear."""

    def __init__(self, dim: int, heads: int, bias: bool = True, causal: bool = False):
        super().__init__()
        assert dim % heads == 0, f"width {dim} not divisible by {heads} heads"
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        qkv = self.qkv(x).reshape(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        x = attention(qkv[0], qkv[1], qkv[2], causal=self.causal)
        return self.proj(x.transpose(1, 2).reshape(B, L, D))


class CrossAttention(nn.Module):
    """Multi-head attention from x (queries) to a context sequence (keys/values)."""

    def __init__(self, dim: int, heads: int, context_dim: int | None = None, bias: bool = True):
        super().__init__()
        assert dim % heads == 0, f"width {dim} not divisible by {heads} heads"
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=bias)
        self.kv = nn.Linear(context_dim or dim, 2 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        H, hd = self.heads, D // self.heads
        q = self.q(x).reshape(B, L, H, hd).transpose(1, 2)
        kv = self.kv(context).reshape(B, context.shape[1], 2, H, hd).permute(2, 0, 3, 1, 4)
        x = attention(q, kv[0], kv[1])
        return self.proj(x.transpose(1, 2).reshape(B, L, D))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: self-attention, optional cross-attention, MLP.

    ``bias=False`` drops the biases of every Linear and LayerNorm (DP-Cap's text decoder).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        mlp_ratio: float = 4.0,
        bias: bool = True,
        causal: bool = False,
        cross_attention: bool = False,
        context_dim: int | None = None,
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6, bias=bias)
        self.attn = Attention(dim, heads, bias=bias, causal=causal)
        if cross_attention:
            self.norm_cross = nn.LayerNorm(dim, eps=1e-6, bias=bias)
            self.cross_attn = CrossAttention(dim, heads, context_dim=context_dim, bias=bias)
        else:
            self.cross_attn = None
        self.norm2 = nn.LayerNorm(dim, eps=1e-6, bias=bias)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), bias=bias)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        if self.cross_attn is not None:
            x = x + self.cross_attn(self.norm_cross(x), context)
        return x + self.mlp(self.norm2(x))


def init_weights(module: nn.Module) -> None:
    """MAE-style init: xavier-uniform Linear, unit LayerNorm, N(0, 0.02) embeddings."""
    if isinstance(module, nn.Linear):
        nn.init.xavier_uniform_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)


def sincos_pos_embed_2d(dim: int, grid_size: int, cls_token: bool = True) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding, (grid_size**2 [+1], dim), as in MAE.

    Half the channels encode the row coordinate and half the column; the cls slot is zeros.
    """
    assert dim % 4 == 0, "sin-cos embedding needs a width divisible by 4"
    coords = torch.arange(grid_size, dtype=torch.float64)
    grid_w, grid_h = torch.meshgrid(coords, coords, indexing="xy")  # MAE puts w first
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4.0))

    def encode_1d(pos: torch.Tensor) -> torch.Tensor:
        out = pos.reshape(-1, 1) * omega.reshape(1, -1)
        return torch.cat([torch.sin(out), torch.cos(out)], dim=1)

    emb = torch.cat([encode_1d(grid_w), encode_1d(grid_h)], dim=1)
    if cls_token:
        emb = torch.cat([torch.zeros(1, dim, dtype=emb.dtype), emb], dim=0)
    return emb.float()


class TextTransformer(nn.Module):
    """Causal transformer over token ids: token + learned position embeddings (two
    nn.Embedding), pre-norm blocks, final LayerNorm.  With ``cross_attention`` every block also
    attends to a context sequence (the captioner's image tokens).

    Assumes right padding: with causal attention a real token never sees the pads after it, so
    padding changes nothing at real positions and needs no extra attention mask.
    """

    def __init__(
        self,
        vocab_size: int,
        width: int,
        depth: int,
        heads: int,
        max_len: int,
        mlp_ratio: float = 4.0,
        bias: bool = True,
        cross_attention: bool = False,
        context_dim: int | None = None,
    ):
        super().__init__()
        self.max_len = max_len
        self.token_embed = nn.Embedding(vocab_size, width)
        self.pos_embed = nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(
            [
                Block(width, heads, mlp_ratio, bias=bias, causal=True,
                      cross_attention=cross_attention, context_dim=context_dim)
                for _ in range(depth)
            ]
        )
        self.norm = nn.LayerNorm(width, eps=1e-6, bias=bias)
        self.apply(init_weights)

    def forward(self, tokens: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        B, L = tokens.shape
        assert L <= self.max_len, f"sequence length {L} exceeds max_len {self.max_len}"
        # Positions get an explicit batch dim so the embedding's per-sample rule sees (B, L) ids.
        positions = torch.arange(L, device=tokens.device).unsqueeze(0).expand(B, L)
        x = self.token_embed(tokens) + self.pos_embed(positions)
        for blk in self.blocks:
            x = blk(x, context)
        return self.norm(x)
