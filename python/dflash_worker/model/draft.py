"""The DFlash / DFlash2 draft network and its two forward paths.

Inference (`step`): one block at a time. The block (anchor + mask tokens) at
positions [s, s + T) attends to every context position < s and to itself;
context keys/values are appended to a `DraftCache` once and kept, block
keys/values are written past the cached length and overwritten by the next
step, so rolling back after verification never copies anything.

Training (`forward_blocks`): M anchored blocks of one sequence in one pass.
Each block sees the context strictly before its anchor plus its own block;
the convolutions run per block. The result equals running `step` block by
block on a fresh cache holding the context prefix.

Output position k of a block predicts the token at anchor + k; logits use the
target's frozen head (`logits`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ConfigError, FamilyError
from .config import DFLASH2, DraftConfig
from .layers import DraftLayer, RMSNorm, Rotary
from .selector import CandidateSelector


def context_features(hidden_states: Sequence[torch.Tensor], target_layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate the outputs of the tapped target layers: [B, L, n * H].

    `hidden_states` is a target's `output_hidden_states` tuple, whose entry 0
    is the embedding output, so decoder layer `i` is entry `i + 1`.
    """
    available = len(hidden_states) - 1
    for lid in target_layer_ids:
        if not 0 <= lid < available:
            raise FamilyError(
                f"draft taps target layer `{lid}` but the target has `{available}` decoder layers\n"
                "hint: the draft was made for a different target"
            )
    return torch.cat([hidden_states[lid + 1] for lid in target_layer_ids], dim=-1)


class DraftCache:
    """Per-layer context keys/values of one generation, grown by doubling.

    Storage is [B, K, capacity, D] per layer; `length` positions are committed
    context. `step` also writes the current block after `length`, which the
    next step overwrites, so no crop is needed.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.length = 0
        self._k: list[torch.Tensor | None] = [None] * num_layers
        self._v: list[torch.Tensor | None] = [None] * num_layers

    def _reserve(self, layer: int, like: torch.Tensor, need: int, keep: int) -> None:
        k = self._k[layer]
        if k is not None and k.shape[2] >= need:
            return
        cap = max(need, 64 if k is None else 2 * k.shape[2])
        B, K, _, D = like.shape
        nk = like.new_empty(B, K, cap, D)
        nv = like.new_empty(B, K, cap, D)
        if k is not None:
            nk[:, :, :keep] = k[:, :, :keep]
            nv[:, :, :keep] = self._v[layer][:, :, :keep]
        self._k[layer], self._v[layer] = nk, nv

    def write(self, layer: int, at: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, K, n, D] at positions [at, at + n); return views of [0, at + n)."""
        end = at + k.shape[2]
        self._reserve(layer, k, end, keep=at)
        self._k[layer][:, :, at:end] = k
        self._v[layer][:, :, at:end] = v
        return self._k[layer][:, :, :end], self._v[layer][:, :, :end]

    def crop(self, length: int) -> None:
        """Forget committed context from `length` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop draft cache of length {self.length} to {length}")
        self.length = length


def _visibility(q_pos, k_pos, is_causal: bool, window: int | None):
    """Position rule of one layer flavour on broadcastable position grids (True = visible)."""
    visible = None
    if is_causal:
        visible = k_pos <= q_pos
    if window is not None:
        near = (q_pos - k_pos) < window
        if not is_causal:
            near = near & ((k_pos - q_pos) < window)
        visible = near if visible is None else visible & near
    return visible


class DraftModel(nn.Module):
    """DFlash (v1) or DFlash2 draft; `config.kind` decides which modules exist."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(config.context_width, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.candidate_selector = CandidateSelector(config) if config.kind == DFLASH2 else None
        self.rotary = Rotary(config)

    # ------------------------------------------------------------------ basics
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    @property
    def kind(self) -> str:
        return self.config.kind

    @torch.no_grad()
    def init_weights_(self, seed: int | None = None, std: float = 0.02) -> DraftModel:
        """Random init for tests and from-scratch runs: normal(0, std) matrices, unit norms,
        identity convolution bases (tap 0 = 1)."""
        gen = torch.Generator(device="cpu")
        gen.manual_seed(0 if seed is None else seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("base_kernel"):
                p.zero_()
                p[:, 0] = 1.0
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self

    def embed(self, token_ids: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
        """Embed block tokens with the target's frozen embedding matrix (times `input_embedding_scale`)."""
        out = F.embedding(token_ids, embedding_weight)
        scale = self.config.input_embedding_scale
        return out * scale if scale != 1.0 else out

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Context projection: `hidden_norm(fc(features))`, [B, L, n*H] -> [B, L, H]."""
        if features.shape[-1] != self.config.context_width:
            raise FamilyError(
                f"context features have width `{features.shape[-1]}`, the draft expects "
                f"`{self.config.context_width}` ({self.config.num_context_layers} layers x {self.config.hidden_size})\n"
                "hint: draft and target hidden sizes or `target_layer_ids` do not match"
            )
        return self.hidden_norm(self.fc(features))

    def logits(self, hidden: torch.Tensor, head) -> torch.Tensor:
        """Logits through the target head (module or weight [V, H]), scaled and soft-capped."""
        weight = head if isinstance(head, torch.Tensor) else getattr(head, "weight", None)
        if weight is not None and weight.dtype != hidden.dtype:
            hidden = hidden.to(weight.dtype)  # e.g. an fp32 draft over a bf16 target head
        if hidden.dim() > 2:
            # one 2-D GEMM: a non-contiguous [M, T-1, H] slice would make `linear` broadcast the
            # [V, H] head into a batched matmul, about twice the time forward and backward
            lead = hidden.shape[:-1]
            hidden = hidden.reshape(-1, hidden.shape[-1])
        else:
            lead = None
        out = F.linear(hidden, head) if isinstance(head, torch.Tensor) else head(hidden)
        if lead is not None:
            out = out.view(*lead, out.shape[-1])
        mult = self.config.output_multiplier
        if mult != 1.0:
            out = out * mult
        cap = self.config.final_logit_softcapping
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    def make_blocks(self, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Block token ids [B, M, T]: the token at each anchor followed by `block_size - 1` mask tokens."""
        B, M = anchors.shape
        blocks = torch.full((B, M, self.block_size), self.mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
        blocks[:, :, 0] = input_ids.gather(1, anchors)
        return blocks

    # ------------------------------------------------------------------ inference
    def new_cache(self) -> DraftCache:
        return DraftCache(len(self.layers))

    def step(self, features: torch.Tensor | None, block_embeds: torch.Tensor, cache: DraftCache) -> torch.Tensor:
        """Draft one block. `features` [B, C, n*H] are the raw target features of the C
        positions after `cache.length` (the newly verified tokens), committed to the
        cache; the block `block_embeds` [B, T, H] sits right after them. Returns the
        normed hidden states [B, T, H]."""
        start = cache.length
        own = self.fc.weight.dtype
        x = block_embeds.to(own)
        if features is not None:
            features = features.to(own)
        B, T, _ = x.shape
        dev, dtype = x.device, x.dtype
        C = 0 if features is None else features.shape[1]
        block_at = start + C
        total = block_at + T
        # one rotary table for the new context and the block: positions start .. total-1
        cos, sin = self.rotary.tables(torch.arange(start, total, device=dev)[None], dtype, total)
        cos_b, sin_b = cos[:, C:], sin[:, C:]
        ctx = self.project_context(features) if C else None
        masks: dict = {}
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h, kern = layer.attention_input(x)
            # context and block share the k/v projections: one pass over [context ; block]
            k, v = attn.keys_values(torch.cat((ctx, h), dim=1) if C else h, cos, sin)
            k_all, v_all = cache.write(i, start, k, v)
            lo = 0
            if attn.window is not None:
                # keys further back than the window from the first query are never visible
                lo = max(0, block_at - attn.window + 1)
                k_all, v_all = k_all[:, :, lo:], v_all[:, :, lo:]
            flavour = (attn.is_causal, attn.window)
            if flavour not in masks:
                if not attn.is_causal and attn.window is None:
                    masks[flavour] = None
                else:
                    q_pos = torch.arange(block_at, total, device=dev)[:, None]
                    k_pos = torch.arange(lo, total, device=dev)[None, :]
                    masks[flavour] = _visibility(q_pos, k_pos, *flavour)[None, None]
            q = attn.queries(h, cos_b, sin_b)
            x = layer.finish(x, attn.attend(q, k_all, v_all, masks[flavour]), kern)
        cache.length = block_at
        return self.norm(x)

    # ------------------------------------------------------------------ training
    def forward_blocks(
        self,
        features: torch.Tensor,
        anchors: torch.Tensor,
        block_embeds: torch.Tensor,
        *,
        attention: str = "auto",
    ) -> torch.Tensor:
        """Draft M anchored blocks per sequence in one pass (training path).

        features [B, L, n*H] raw target features of the whole sequence; anchors
        [B, M] positions (0 <= a <= L; block m covers positions a_m .. a_m + T - 1
        and sees context positions < a_m); block_embeds [B, M, T, H] (see `embed`,
        `make_blocks`). `attention`: "sdpa" (explicit boolean mask), "flex"
        (torch flex attention, CUDA) or "auto" (flex on CUDA when available).
        Returns normed hidden states [B, M, T, H].
        """
        B, L, _ = features.shape
        Bm, M, T, H = block_embeds.shape
        if anchors.shape != (B, M) or Bm != B:
            raise ConfigError(
                f"anchors have shape `{tuple(anchors.shape)}` and block embeddings `{tuple(block_embeds.shape)}` "
                f"for features `{tuple(features.shape)}`; expected anchors `[{B}, M]` and blocks `[{B}, M, T, {self.config.hidden_size}]`"
            )
        if M and (int(anchors.min()) < 0 or int(anchors.max()) > L):
            raise ConfigError(f"anchor positions must lie in `[0, {L}]`, found `[{int(anchors.min())}, {int(anchors.max())}]`")
        dev, dtype = block_embeds.device, block_embeds.dtype
        use_flex = attention == "flex" or (attention == "auto" and dev.type == "cuda" and _flex_available())
        if attention not in ("auto", "sdpa", "flex"):
            raise ConfigError(f"unknown attention backend `{attention}`\nhint: use `auto`, `sdpa` or `flex`")

        ctx = self.project_context(features)
        pos_ctx = torch.arange(L, device=dev)
        pos_blk = (anchors[:, :, None] + torch.arange(T, device=dev)).reshape(B, M * T)
        limit = max(L, (int(anchors.max()) if M else 0) + T)
        cos_c, sin_c = self.rotary.tables(pos_ctx[None], dtype, limit)
        cos_b, sin_b = self.rotary.tables(pos_blk, dtype, limit)
        cos_kv = torch.cat((cos_c.expand(B, -1, -1), cos_b), dim=1)
        sin_kv = torch.cat((sin_c.expand(B, -1, -1), sin_b), dim=1)

        masks: dict = {}
        x = block_embeds.reshape(B * M, T, H)
        for layer in self.layers:
            attn = layer.self_attn
            flavour = (attn.is_causal, attn.window)
            if flavour not in masks:
                masks[flavour] = (
                    _flex_block_mask(anchors, L, T, *flavour)
                    if use_flex
                    else _training_mask(anchors, L, T, pos_blk, *flavour)
                )
            h, kern = layer.attention_input(x)
            h_flat = h.reshape(B, M * T, H)
            k_all, v_all = attn.keys_values(torch.cat((ctx, h_flat), dim=1), cos_kv, sin_kv)
            q = attn.queries(h_flat, cos_b, sin_b)
            if use_flex:
                out = _flex_attend(attn, q, k_all, v_all, masks[flavour])
            else:
                # SDPA turns a boolean mask into an additive one (0 / -inf in the query dtype) on
                # every call, forward and backward; doing it once per flavour gives the same
                # values, and every layer's backward shares one saved mask
                key = (flavour, q.dtype)
                if key not in masks:
                    masks[key] = torch.zeros(masks[flavour].shape, dtype=q.dtype, device=dev).masked_fill_(
                        ~masks[flavour], float("-inf")
                    )
                out = attn.attend(q, k_all, v_all, masks[key])
            x = layer.finish(x, out.reshape(B * M, T, H), kern)
        return self.norm(x).view(B, M, T, H)

    def forward(self, features: torch.Tensor, anchors: torch.Tensor, block_embeds: torch.Tensor, *, attention: str = "auto"):
        """`forward_blocks` (so DDP/FSDP wrappers, which call `forward`, see the training path)."""
        return self.forward_blocks(features, anchors, block_embeds, attention=attention)

    # ------------------------------------------------------------------ selector
    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, head, temperature: float = 0.0, generator=None):
        """DFlash2 proposal for block positions 1..T-1: (tokens [B, T-1], candidates [B, T-1, k],
        selection probabilities or None). `hidden` holds positions 1..T-1 only."""
        if self.candidate_selector is None:
            raise ConfigError("this draft has no candidate selector (dflash v1)")
        return self.candidate_selector.walk(hidden, self.logits(hidden, head), anchor_ids, temperature, generator)


def _training_mask(anchors, L: int, T: int, pos_blk, is_causal: bool, window: int | None) -> torch.Tensor:
    """Boolean [B, 1, M*T, L + M*T]: own block, plus context strictly before the anchor."""
    B, M = anchors.shape
    dev = anchors.device
    q_anchor = anchors.repeat_interleave(T, dim=1)  # [B, MT]
    ctx_vis = torch.arange(L, device=dev)[None, None, :] < q_anchor[:, :, None]  # [B, MT, L]
    blk_id = torch.arange(M, device=dev).repeat_interleave(T)
    blk_vis = (blk_id[:, None] == blk_id[None, :]).expand(B, M * T, M * T)
    visible = torch.cat((ctx_vis, blk_vis), dim=2)
    k_pos = torch.cat((torch.arange(L, device=dev).expand(B, L), pos_blk), dim=1)
    rule = _visibility(pos_blk[:, :, None], k_pos[:, None, :], is_causal, window)
    if rule is not None:
        visible = visible & rule
    return visible[:, None]


_FLEX = None


def _flex_available() -> bool:
    global _FLEX
    if _FLEX is None:
        try:
            from torch.nn.attention import flex_attention as fa

            _FLEX = fa
        except Exception:  # very old torch
            _FLEX = False
    return bool(_FLEX)


def _flex_block_mask(anchors, L: int, T: int, is_causal: bool, window: int | None):
    if not _flex_available():
        raise ConfigError("flex attention is not available in this torch build\nhint: use `attention=\"sdpa\"`")
    B, M = anchors.shape
    MT = M * T

    def mask_mod(b, h, q_idx, kv_idx):
        q_blk = q_idx // T
        q_pos = anchors[b, q_blk] + q_idx % T
        is_ctx = kv_idx < L
        rel = (kv_idx - L).clamp(min=0)
        k_blk = rel // T
        k_pos = torch.where(is_ctx, kv_idx, anchors[b, k_blk.clamp(max=M - 1)] + rel % T)
        ok = torch.where(is_ctx, kv_idx < anchors[b, q_blk], k_blk == q_blk)
        if is_causal:
            ok = ok & (k_pos <= q_pos)
        if window is not None:
            ok = ok & (q_pos - k_pos < window)
            if not is_causal:
                ok = ok & (k_pos - q_pos < window)
        return ok

    return _FLEX.create_block_mask(mask_mod, B, None, MT, L + MT, device=anchors.device)


_FLEX_COMPILED = None


def _flex_attend(attn, q, k, v, block_mask):
    global _FLEX_COMPILED
    groups = attn.num_heads // attn.num_kv_heads
    fn = _FLEX.flex_attention
    if q.is_cuda:
        # eager flex attention materialises the full score matrix; the compiled kernel is the point on CUDA
        if _FLEX_COMPILED is None:
            _FLEX_COMPILED = torch.compile(_FLEX.flex_attention)
        fn = _FLEX_COMPILED
    out = fn(q, k, v, block_mask=block_mask, scale=attn.head_dim**-0.5, enable_gqa=groups > 1)
    B, _, T, _ = out.shape
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, attn.num_heads * attn.head_dim))


def build_draft(config: DraftConfig, *, device="cpu", dtype: torch.dtype | None = None, seed: int | None = None) -> DraftModel:
    """A randomly initialised draft (see `DraftModel.init_weights_`)."""
    model = DraftModel(config).init_weights_(seed)
    return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
