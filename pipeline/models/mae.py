"""Masked autoencoder (He et al. 2022) as used by ViP, returning a per-sample loss.

The ViP loss is a sum of independent per-sample terms (seed 003, eq. 4), which is what makes
it directly compatible with per-sample clipping: ``forward`` returns that vector, shape (B,).
"""

import torch
import torch.nn as nn

from .layers import Block, MaskToken, init_weights, sincos_pos_embed_2d
from .vit import VisionTransformer, patchify


class MaskedAutoencoder(nn.Module):
    """ViT encoder on the visible patches + light ViT decoder that predicts masked pixels."""

    def __init__(
        self,
        encoder: VisionTransformer,
        decoder_width: int,
        decoder_depth: int,
        decoder_heads: int,
        mask_ratio: float,
        norm_pix_loss: bool,
        mlp_ratio: float = 4.0,
    ):
        super().__init__()
        self.encoder = encoder  # kept whole so its state_dict moves to the other models
        self.mask_ratio = mask_ratio
        self.norm_pix_loss = norm_pix_loss
        p, c = encoder.patch_size, encoder.in_chans

        self.decoder_embed = nn.Linear(encoder.width, decoder_width)
        self.mask_token = MaskToken(decoder_width)
        self.register_buffer(
            "decoder_pos_embed",
            sincos_pos_embed_2d(decoder_width, encoder.grid_size).unsqueeze(0),
            persistent=False,
        )
        self.decoder_blocks = nn.ModuleList(
            [Block(decoder_width, decoder_heads, mlp_ratio) for _ in range(decoder_depth)]
        )
        self.decoder_norm = nn.LayerNorm(decoder_width, eps=1e-6)
        self.decoder_pred = nn.Linear(decoder_width, p * p * c)
        for module in (self.decoder_embed, self.decoder_blocks, self.decoder_norm, self.decoder_pred):
            module.apply(init_weights)

    def forward_decoder(self, x: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """Encoder tokens (B, 1 + L_keep, D) -> pixel predictions for all patches (B, L, p*p*C)."""
        x = self.decoder_embed(x)
        B, L = ids_restore.shape
        # Append one mask token per removed patch, then unshuffle to the original patch order.
        mask_tokens = self.mask_token(x).expand(B, L + 1 - x.shape[1], x.shape[2])
        x_ = torch.cat([x[:, 1:, :], mask_tokens], dim=1)
        x_ = torch.gather(x_, 1, ids_restore.unsqueeze(-1).expand(-1, -1, x.shape[2]))
        x = torch.cat([x[:, :1, :], x_], dim=1) + self.decoder_pos_embed
        for blk in self.decoder_blocks:
            x = blk(x)
        x = self.decoder_pred(self.decoder_norm(x))
        return x[:, 1:, :]  # drop the cls slot

    def per_sample_loss(self, imgs: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean squared error over the masked patches of each sample, shape (B,)."""
        target = patchify(imgs, self.encoder.patch_size)
        if self.norm_pix_loss:  # per-patch normalisation: stays within one sample
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1e-6) ** 0.5
        loss = ((pred - target) ** 2).mean(dim=-1)  # (B, L) per patch
        return (loss * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)

    def reconstruct(self, imgs: torch.Tensor, noise: torch.Tensor | None = None):
        """Returns (per-sample loss (B,), predicted patches (B, L, p*p*C), mask (B, L))."""
        latent, mask, ids_restore = self.encoder.forward_features(imgs, self.mask_ratio, noise)
        pred = self.forward_decoder(latent, ids_restore)
        return self.per_sample_loss(imgs, pred, mask), pred, mask

    def forward(self, imgs: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Per-sample loss (B,). ``noise`` (B, L) fixes the masks (needed under vmap)."""
        return self.reconstruct(imgs, noise)[0]
