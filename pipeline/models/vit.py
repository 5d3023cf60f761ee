"""Vision Transformer encoder (MAE-style), written for per-sample-gradient DP training.

Differences from the usual timm/MAE ViT, all for the DP engine (see layers.py):
* patch embedding is an nn.Linear on flattened patches instead of a Conv2d (same parameter
  count; weight layout is (p, p, C) per patch instead of Conv's (C, p, p));
* the cls token lives in its own ``ClassToken`` leaf module;
* position embeddings are a fixed sin-cos buffer (not a parameter, not in the state_dict:
  they are a pure function of the config).
"""

import torch
import torch.nn as nn

from .layers import Block, ClassToken, init_weights, sincos_pos_embed_2d

# Encoder shapes.  base/large are ViT-B and ViT-L.  ViP (seed 003) names MAE-Nano/Tiny/Small/
# Base/Large with widths 192/384/576/768/1024 but its Table 4 (depth/heads) is not in the
# seed, so nano/tiny/small ASSUME depth 12 and heads = width / 64 (= ViT-Ti/ViT-S for nano/tiny).
# micro/pico/cpu are not from any paper: micro for unit tests, cpu for 32x32 images / patch 4 on CPU,
# pico the same at two thirds of the width (tried as a faster CPU recipe and not taken: docs/results.md,
# "Wall time").
VIT_SIZES = {
    "micro": dict(width=32, depth=1, heads=2),
    "pico": dict(width=64, depth=4, heads=2),
    "cpu": dict(width=96, depth=4, heads=3),
    "nano": dict(width=192, depth=12, heads=3),
    "tiny": dict(width=384, depth=12, heads=6),
    "small": dict(width=576, depth=12, heads=9),
    "base": dict(width=768, depth=12, heads=12),
    "large": dict(width=1024, depth=24, heads=16),
}


def patchify(imgs: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, L, p*p*C), patches in row-major order, pixels ordered (p, p, C)."""
    B, C, H, W = imgs.shape
    assert H % p == 0 and W % p == 0, f"image {H}x{W} not divisible by patch {p}"
    h, w = H // p, W // p
    x = imgs.reshape(B, C, h, p, w, p)
    x = torch.einsum("nchpwq->nhwpqc", x)
    return x.reshape(B, h * w, p * p * C)


def unpatchify(x: torch.Tensor, p: int, channels: int = 3) -> torch.Tensor:
    """(B, L, p*p*C) -> (B, C, H, W); inverse of ``patchify`` for square images."""
    B, L, _ = x.shape
    h = w = int(L**0.5)
    assert h * w == L, "unpatchify expects a square grid of patches"
    x = x.reshape(B, h, w, p, p, channels)
    x = torch.einsum("nhwpqc->nchpwq", x)
    return x.reshape(B, channels, h * p, w * p)


def random_masking(x: torch.Tensor, mask_ratio: float, noise: torch.Tensor | None = None):
    """MAE per-sample random masking by argsort of uniform noise.

    x: (B, L, D); noise: (B, L) or None (then drawn with torch.rand).  Passing noise lets a
    caller fix the masks, and is required under torch.func.vmap, where torch.rand is not allowed
    by default.  Returns the kept tokens (B, L_keep, D), the binary mask (B, L; 1 = removed)
    and ids_restore (B, L) that undoes the shuffle.
    """
    B, L, D = x.shape
    len_keep = int(L * (1 - mask_ratio))
    if noise is None:
        noise = torch.rand(B, L, device=x.device)
    ids_shuffle = torch.argsort(noise, dim=1)  # small noise is kept, large is removed
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    ids_keep = ids_shuffle[:, :len_keep]
    x_kept = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, D))
    # Build the mask in shuffled order (first len_keep kept), then unshuffle. fp32 under autocast too:
    # bf16 counts masked patches past 256 inexactly.
    mask = torch.ones(B, L, device=x.device)
    mask[:, :len_keep] = 0
    mask = torch.gather(mask, 1, ids_restore)
    return x_kept, mask, ids_restore


class VisionTransformer(nn.Module):
    """ViT encoder with optional MAE masking; ``encode`` returns (B, width) features."""

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        width: int = 768,
        depth: int = 12,
        heads: int = 12,
        mlp_ratio: float = 4.0,
        pool: str = "cls",
    ):
        super().__init__()
        assert img_size % patch_size == 0
        self.img_size, self.patch_size, self.in_chans = img_size, patch_size, in_chans
        self.width, self.depth, self.heads = width, depth, heads
        self.pool = pool
        self.grid_size = img_size // patch_size
        self.num_patches = self.grid_size**2

        self.patch_embed = nn.Linear(patch_size * patch_size * in_chans, width)
        self.cls_token = ClassToken(width)
        self.register_buffer(
            "pos_embed", sincos_pos_embed_2d(width, self.grid_size).unsqueeze(0), persistent=False
        )
        self.blocks = nn.ModuleList([Block(width, heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(width, eps=1e-6)
        self.apply(init_weights)
        # MAE initialises the patch projection like a Linear on the flattened patch (it already is).

    def forward_features(self, imgs: torch.Tensor, mask_ratio: float = 0.0, noise: torch.Tensor | None = None):
        """Returns (tokens (B, 1 + L_keep, D) incl. cls, after the final norm; mask (B, L);
        ids_restore (B, L))."""
        x = self.patch_embed(patchify(imgs, self.patch_size))
        x = x + self.pos_embed[:, 1:, :]
        B, L, _ = x.shape
        if mask_ratio > 0:
            x, mask, ids_restore = random_masking(x, mask_ratio, noise)
        else:
            mask = x.new_zeros(B, L)
            ids_restore = torch.arange(L, device=x.device).unsqueeze(0).expand(B, L)
        cls = self.cls_token(x) + self.pos_embed[:, :1, :]
        x = torch.cat([cls, x], dim=1)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x), mask, ids_restore

    def encode(self, imgs: torch.Tensor, pool: str | None = None) -> torch.Tensor:
        """Unmasked features for probing: the cls token, or the mean of the patch tokens."""
        pool = pool or self.pool
        x, _, _ = self.forward_features(imgs)
        if pool == "cls":
            return x[:, 0]
        if pool == "mean":
            return x[:, 1:].mean(dim=1)
        raise ValueError(f"unknown pool {pool!r}; use 'cls' or 'mean'")

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.encode(imgs)


def build_vit(size: str = "base", img_size: int = 224, patch_size: int = 16, in_chans: int = 3, **kwargs) -> VisionTransformer:
    """A VisionTransformer of a named size from ``VIT_SIZES`` (kwargs override the table)."""
    if size not in VIT_SIZES:
        raise ValueError(f"unknown ViT size {size!r}; choose from {sorted(VIT_SIZES)}")
    arch = {**VIT_SIZES[size], **kwargs}
    return VisionTransformer(img_size=img_size, patch_size=patch_size, in_chans=in_chans, **arch)
