"""Building blocks of a DFlash draft layer.

Shape legend used in names: B batch, T block tokens, C context tokens,
S key span (context + block), H hidden size, N query heads, K kv heads,
D head dim, G conv groups, W conv kernel size.

A draft layer is a pre-norm Qwen3 decoder layer whose queries come from the
block only, while keys/values come from the same projections applied to the
context (projected target features) and to the block. DFlash2 wraps the
attention and the MLP in grouped dynamic causal convolutions that run along
the block axis, so they never mix tokens of different blocks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ConfigError
from .config import DraftConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in at least float32, scaled in the input dtype (Qwen3 convention)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        wide = x if dtype == torch.float64 else x.float()
        return self.weight * F.rms_norm(wide, (wide.shape[-1],), eps=self.eps).to(dtype)


class Rotary:
    """Rotary position tables; inverse frequencies are kept per device, outside the state dict.

    Not an `nn.Module` buffer on purpose: the draft is built on the meta device
    and filled by streaming, and these values are derived from the config, never
    stored in a checkpoint.
    """

    def __init__(self, config: DraftConfig) -> None:
        hf = config.hf_config()
        params = dict(hf.rope_parameters or {})
        rope_type = params.get("rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            raise ConfigError(
                f"{config.source}: rope type `{rope_type}` changes with sequence length and is not supported for drafts"
            )
        if rope_type == "default":
            dim = config.head_dim
            base = float(params["rope_theta"])
            exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
            self.inv_freq = 1.0 / (base**exponents)
            self.scale = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
            self.inv_freq = inv_freq.float()
            self.scale = float(scale)
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape positions.shape + (D,) for integer `positions` < `limit`.

        Values come from one float32 table per device indexed by position, so a
        position gets bit-identical tables whichever batch or block layout asks
        for it (vectorised cos/sin may differ in the last ulp with tensor length).
        """
        have = self._cache.get(positions.device)
        if have is None or have[0].shape[0] < limit:
            size = max(256, 1 << max(0, limit - 1).bit_length())
            inv = self.inv_freq.to(positions.device)
            angles = torch.arange(size, device=positions.device, dtype=torch.float32)[:, None] * inv
            angles = torch.cat((angles, angles), dim=-1)
            have = self._cache[positions.device] = (angles.cos() * self.scale, angles.sin() * self.scale)
        cos, sin = have
        return cos[positions].to(dtype), sin[positions].to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE: x * cos + rot90(x) * sin, where rot90 maps (a, b) -> (-b, a) across halves."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class GatedMLP(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        if config.hidden_act not in ACT2FN:
            raise ConfigError(f"{config.source}: unknown `hidden_act` `{config.hidden_act}`")
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DynamicBlockConv(nn.Module):
    """Grouped dynamic causal convolution along the block axis (DFlash2).

    out[t, h] = sum_o (base[o, h] + dyn[t, o, group(h)]) * x[t - o, h], with
    x[t - o] = 0 before the block start. `base_kernel[0]` and the first half of
    the projected kernels feed `before` (applied to the normed input); the
    second half is kept for `after` (applied to the sublayer output).
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def _mix(self, x_BTH: torch.Tensor, dyn_BTWG: torch.Tensor, base_WH: torch.Tensor) -> torch.Tensor:
        B, T, H = x_BTH.shape
        W, G = self.kernel_size, self.groups
        x = x_BTH.view(B, T, G, self.group_size)
        base = base_WH.to(x.dtype).view(W, 1, 1, G, self.group_size)
        # Zero-pad W-1 steps before the block start: tap o reads the token o steps earlier.
        padded = F.pad(x, (0, 0, 0, 0, W - 1, 0))
        # Per-tap coefficients (base + dyn): never materialising the [B, T, W, G, g] stack keeps
        # its slice gradients (zero-filled full-size buffers per tap) out of the backward pass.
        out = x * (base[0] + dyn_BTWG[:, :, 0, :, None])
        for o in range(1, W):
            out = out + padded[:, W - 1 - o : W - 1 - o + T] * (base[o] + dyn_BTWG[:, :, o, :, None])
        return out.view(B, T, H)

    def before(self, x_BTH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dyn = self.kernel_projection(x_BTH).unflatten(-1, (2, self.kernel_size, self.groups))
        return self._mix(x_BTH, dyn[:, :, 0], self.base_kernel[0]), dyn[:, :, 1]

    def after(self, y_BTH: torch.Tensor, dyn_BTWG: torch.Tensor) -> torch.Tensor:
        return self._mix(y_BTH, dyn_BTWG, self.base_kernel[1])


class DraftAttention(nn.Module):
    """Block queries attending over [context ; block] keys with shared k/v projections."""

    def __init__(self, config: DraftConfig, index: int) -> None:
        super().__init__()
        H, N, K, D = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = N, K, D
        self.q_proj = nn.Linear(H, N * D, bias=bias)
        self.k_proj = nn.Linear(H, K * D, bias=bias)
        self.v_proj = nn.Linear(H, K * D, bias=bias)
        self.o_proj = nn.Linear(N * D, H, bias=bias)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)
        self.is_causal = config.layer_is_causal(index)
        self.window = config.layer_window(index)

    def keys_values(self, x_BSH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed, rotated keys and values [B, K, S, D] for hidden states at the given rotary tables."""
        B, S, _ = x_BSH.shape
        k = self.k_norm(self.k_proj(x_BSH).view(B, S, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BSH).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, cos[:, None], sin[:, None]), v

    def queries(self, x_BTH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTH.shape
        q = self.q_norm(self.q_proj(x_BTH).view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        return rotate(q, cos[:, None], sin[:, None])

    def attend(self, q_BNTD, k_BKSD, v_BKSD, mask) -> torch.Tensor:
        """SDPA with GQA; `mask` is a boolean `[B|1, 1, T, S]` (True = visible) or None."""
        gqa = self.num_heads != self.num_kv_heads
        if gqa and q_BNTD.device.type == "mps":
            # grouped-query SDPA is not implemented by every MPS build: expand the kv heads instead
            groups = self.num_heads // self.num_kv_heads
            k_BKSD = k_BKSD.repeat_interleave(groups, dim=1)
            v_BKSD = v_BKSD.repeat_interleave(groups, dim=1)
            gqa = False
        out = F.scaled_dot_product_attention(q_BNTD, k_BKSD, v_BKSD, attn_mask=mask, scale=self.head_dim**-0.5, enable_gqa=gqa)
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer; attention and MLP optionally wrapped by block convolutions."""

    def __init__(self, config: DraftConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.self_attn = DraftAttention(config, index)
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.kind == "dflash2":
            self.attention_conv = DynamicBlockConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
            self.mlp_conv = DynamicBlockConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
        else:
            self.attention_conv = None
            self.mlp_conv = None

    def attention_input(self, x_BTH: torch.Tensor):
        h = self.input_layernorm(x_BTH)
        kern = None
        if self.attention_conv is not None:
            h, kern = self.attention_conv.before(h)
        return h, kern

    def finish(self, x_BTH: torch.Tensor, attn_BTH: torch.Tensor, kern) -> torch.Tensor:
        """Residual add of the attention output, then the (convolved) MLP sublayer."""
        if kern is not None:
            attn_BTH = self.attention_conv.after(attn_BTH, kern)
        x_BTH = x_BTH + attn_BTH
        h = self.post_attention_layernorm(x_BTH)
        if self.mlp_conv is not None:
            h, kern = self.mlp_conv.before(h)
            return x_BTH + self.mlp_conv.after(self.mlp(h), kern)
        return x_BTH + self.mlp(h)
