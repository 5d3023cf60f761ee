"""CLIP (Radford et al. 2021) for Dp-CLIP (Huang et al. 2023, seed 002).

BATCH-COUPLED: the InfoNCE term of sample i uses every other sample of the batch as a
negative, so "per-sample" losses are not independent and per-sample clipping does not bound
one example's influence.  Dp-CLIP therefore clips the gradient of the whole batch loss
(per-batch clipping); ``forward`` still returns the (B,) vector whose mean is the usual loss.

With ``public_negatives`` (objective ``clip-public``) the batch is not coupled: image i is scored
against its own caption and a fixed set of public captions (the tokenizer's public corpus), encoded
without gradient, so sample i's loss and gradient are functions of (image i, caption i) and public
text alone, and per-sample clipping bounds them (docs/privacy.md, "clip-public").
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import LogitScale, TextTransformer, init_weights
from .vit import VisionTransformer


class CLIP(nn.Module):
    def __init__(
        self,
        encoder: VisionTransformer,
        vocab_size: int,
        text_width: int,
        text_depth: int,
        text_heads: int,
        max_len: int,
        embed_dim: int,
        pad_id: int,
        pool: str,
        mlp_ratio: float = 4.0,
        public_negatives: int = 0,
    ):
        super().__init__()
        self.encoder = encoder  # image tower; same class/state_dict as the MAE encoder
        self.pad_id = pad_id
        self.pool = pool
        self.text = TextTransformer(vocab_size, text_width, text_depth, text_heads, max_len, mlp_ratio)
        self.image_proj = nn.Linear(encoder.width, embed_dim, bias=False)
        self.text_proj = nn.Linear(text_width, embed_dim, bias=False)
        self.logit_scale = LogitScale(0.07)
        self.image_proj.apply(init_weights)
        self.text_proj.apply(init_weights)
        # Public captions as token ids (K, max_len); until training sets the corpus's own
        # (`set_public_negatives`), token ids drawn from a fixed public seed: public either way.
        self.per_sample = public_negatives > 0
        if self.per_sample:
            ids = torch.randint(4, vocab_size, (public_negatives, max_len), generator=torch.Generator().manual_seed(0),
                                device="cpu")
            self.register_buffer("public_negatives", ids)
            # The text tower stays at its seeded init (public): its captions' embeddings are fixed targets.
            # Trained, it only ever draws captions toward images (the negatives carry no gradient), and
            # every caption drew together: zero-shot at chance without noise (docs/results.md).
            self.text.requires_grad_(False)
            self.text_proj.requires_grad_(False)

    def set_public_negatives(self, tokens: torch.Tensor) -> None:
        """The public captions every image is scored against, (K, max_len) token ids."""
        if not self.per_sample or tokens.shape != self.public_negatives.shape:
            raise ValueError(f"public negatives of shape {tuple(tokens.shape)} for a model that "
                             + (f"takes {tuple(self.public_negatives.shape)}" if self.per_sample else "has none"))
        self.public_negatives = tokens.to(self.public_negatives.device)

    def encode_image(self, imgs: torch.Tensor) -> torch.Tensor:
        """L2-normalised image embeddings, (B, embed_dim)."""
        return F.normalize(self.image_proj(self.encoder.encode(imgs, self.pool)), dim=-1)

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        """L2-normalised text embeddings, (B, embed_dim), read at the last non-pad token (EOS)."""
        x = self.text(tokens)
        L = tokens.shape[1]
        positions = torch.arange(L, device=tokens.device).expand_as(tokens)
        # Largest position holding a real token (0 for an all-pad row, which then reads BOS slot).
        last = torch.where(tokens != self.pad_id, positions, torch.zeros_like(positions)).amax(dim=1)
        pooled = torch.gather(x, 1, last.view(-1, 1, 1).expand(-1, 1, x.shape[-1])).squeeze(1)
        return F.normalize(self.text_proj(pooled), dim=-1)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """CLIP's clamp, held on the parameter after each step as open_clip holds it: clamped in the forward
        pass alone, a log scale past ln 100 gets no gradient, and DP-SGD's noise walks it on unseen."""
        self.logit_scale.weight.clamp_(0.0, math.log(100.0))

    def _scale(self, img: torch.Tensor) -> torch.Tensor:
        # The (B,) broadcast of the log temperature keeps the leaf-module contract; clamp as CLIP.
        return self.logit_scale(img).clamp(max=math.log(100.0)).exp()

    def forward(self, imgs: torch.Tensor, tokens: torch.Tensor, gather=None) -> torch.Tensor:
        """Symmetric InfoNCE per sample, (B,): mean of the image->text and text->image terms.
        Batch-coupled (see module docstring); ``.mean()`` gives the standard CLIP loss.

        ``gather(x) -> (x of every rank, offset of this rank's rows)`` (distributed.gather_with_grad)
        makes each rank's terms those of the whole batch split across ranks, as open_clip does: the
        ranks' losses, and their gradients, add up to those of one process holding the whole batch."""
        if self.per_sample:
            return self.public_contrast(imgs, tokens)
        img, txt = self.encode_image(imgs), self.encode_text(tokens)
        all_img, offset = gather(img) if gather else (img, 0)
        all_txt, _ = gather(txt) if gather else (txt, 0)
        scale = self._scale(img).unsqueeze(1)
        labels = torch.arange(offset, offset + len(img), device=img.device)
        loss_i2t = F.cross_entropy(scale * img @ all_txt.t(), labels, reduction="none")
        loss_t2i = F.cross_entropy(scale * txt @ all_img.t(), labels, reduction="none")
        return 0.5 * (loss_i2t + loss_t2i)

    def public_contrast(self, imgs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Per sample (B,): InfoNCE of image i against its own caption, with the public captions as the
        negatives. They are encoded without gradient (as constants, like MoCo's queue) and a public
        caption identical to caption i is left out of its row, so row i reads nothing of another
        example: the loss splits per sample and per-sample clipping bounds each one's gradient."""
        img, txt = self.encode_image(imgs), self.encode_text(tokens)
        with torch.no_grad():
            negatives = self.encode_text(self.public_negatives)
        scale = self._scale(img).unsqueeze(1)
        same = (tokens.unsqueeze(1) == self.public_negatives.unsqueeze(0)).all(-1)  # (B, K)
        logits = scale * torch.cat([(img * txt).sum(-1, keepdim=True), img @ negatives.t()], dim=1)
        logits = logits.masked_fill(torch.cat([torch.zeros_like(same[:, :1]), same], dim=1), float("-inf"))
        return F.cross_entropy(logits, torch.zeros(len(img), dtype=torch.long, device=img.device), reduction="none")
