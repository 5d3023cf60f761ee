"""DP-Cap image captioner (Sander et al. 2024, seeds 000/001).

ViT encoder -> image tokens -> causal text decoder with cross-attention, trained by next-token
prediction.  The loss of sample i depends only on (image i, caption i), so it is a sum of
per-sample terms and fits DP-SGD's per-sample clipping; ``forward`` returns that vector (B,).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import TextTransformer, init_weights
from .vit import VisionTransformer


class Captioner(nn.Module):
    """Encoder-decoder captioner.

    Token convention (set by the tokenizer, not here): each caption is right-padded with
    ``pad_id`` to at most ``max_len`` ids and already contains its BOS/EOS ids.  Position t
    predicts token t+1; targets equal to ``pad_id`` are ignored.
    """

    def __init__(
        self,
        encoder: VisionTransformer,
        vocab_size: int,
        width: int,
        depth: int,
        heads: int,
        max_len: int,
        pad_id: int,
        mask_ratio: float,
        mlp_ratio: float = 4.0,
        bias: bool = False,  # DP-Cap's decoder has no biases
    ):
        super().__init__()
        self.encoder = encoder
        self.mask_ratio = mask_ratio
        self.pad_id = pad_id
        self.image_proj = nn.Linear(encoder.width, width, bias=bias)
        self.decoder = TextTransformer(
            vocab_size, width, depth, heads, max_len, mlp_ratio, bias=bias, cross_attention=True
        )
        self.head = nn.Linear(width, vocab_size, bias=bias)  # untied from decoder.token_embed
        self.image_proj.apply(init_weights)
        self.head.apply(init_weights)

    def encode_image(self, imgs: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Image tokens for cross-attention, (B, 1 + L_keep, width)."""
        tokens, _, _ = self.encoder.forward_features(imgs, self.mask_ratio, noise)
        return self.image_proj(tokens)

    def caption_loss(self, memory: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Token-mean next-token cross-entropy per sample, (B,), given image tokens ``memory``."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = self.head(self.decoder(inputs, memory))
        nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, L-1)
        keep = (targets != self.pad_id).to(nll.dtype)
        return (nll * keep).sum(dim=1) / keep.sum(dim=1).clamp_min(1.0)

    def forward(self, imgs: torch.Tensor, tokens: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Per-sample loss (B,). ``noise`` fixes the image masks when mask_ratio > 0."""
        return self.caption_loss(self.encode_image(imgs, noise), tokens)

    def score_captions(self, imgs: torch.Tensor, candidates: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
        """Loss of every candidate caption for every image, (B, K); lower = more likely.

        Zero-shot classification takes the argmin over class prompts.  Images are encoded once
        (unmasked); candidates (K, L) are decoded ``chunk_size`` at a time to bound memory.
        """
        memory = self.image_proj(self.encoder.forward_features(imgs)[0])
        B = memory.shape[0]
        scores = []
        for chunk in candidates.split(chunk_size):
            k = chunk.shape[0]
            mem = memory.repeat_interleave(k, dim=0)  # image b paired with each candidate
            toks = chunk.repeat(B, 1)
            scores.append(self.caption_loss(mem, toks).view(B, k))
        return torch.cat(scores, dim=1)

    def zero_shot_predict(self, imgs: torch.Tensor, candidates: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
        """Index of the lowest-loss candidate per image, (B,)."""
        return self.score_captions(imgs, candidates, chunk_size).argmin(dim=1)
