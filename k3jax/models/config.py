"""Model configuration: a frozen dataclass validated at construction.

The layer stack is described by `mixer_pattern`, one letter per layer, repeated to `num_layers`:
``"A"`` = causal softmax attention, ``"K"`` = Kimi Delta Attention. ``ffn`` picks the feed-forward
(``"mlp"`` = SwiGLU, ``"moe"`` = routed experts) and ``residual`` the residual scheme.
"""
from __future__ import annotations

import dataclasses

MIXERS = {"A": "attention", "K": "kda"}
FFNS = ("mlp", "moe")
RESIDUALS = ("prenorm", "block_attnres", "full_attnres", "article_block")
DTYPES = ("float32", "bfloat16")
REMAT = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
SCAN_RESIDUALS = ("prenorm", "block_attnres", "full_attnres")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of the hybrid language model.

    Attributes:
      vocab_size: number of token ids the tokenizer produces (byte tokenizer: 259). The embedding table
        is padded up to a multiple of 64; padded ids are never targets and are masked when sampling.
      d_model: hidden size D.
      num_layers: transformer layers (each = one mixer sublayer + one FFN sublayer).
      num_heads: heads of every mixer.
      head_dim: per-head size (K = V = head_dim for KDA).
      mixer_pattern: letters from {"A", "K"}, tiled over the layers ("KKKA" = 3 KDA : 1 attention).
      d_ff: SwiGLU hidden size (per expert for MoE).
      ffn: "mlp" or "moe".
      residual: "prenorm" (plain PreNorm residual stream) | "block_attnres" (Block Attention Residuals,
        arXiv 2603.15031: each sublayer reads a softmax mix over [embedding, block sums, partial sum]) |
        "full_attnres" (N = L: every sublayer output is its own source) | "article_block" (the seed
        article's literal version: alpha-scaled attention output replaces the stream at block ends).
      residual_blocks: N, the number of blocks for "block_attnres" and "article_block".
      residual_block_unit: what "block_attnres" blocks count: "sublayers" (paper) or "layers" (K3).
        "article_block" always groups whole layers.
      attention_rope: rotary position embedding in attention layers (False = NoPE, as K3's hybrid).
      rope_theta: RoPE base.
      dtype: compute dtype ("bfloat16" or "float32"); parameters are always float32.
      norm_eps: RMSNorm epsilon.
      kda_gate: "bounded" (lower_bound * sigmoid, K3) or "softplus" (Kimi Linear).
      kda_lower_bound: lower bound of the bounded log-decay gate (natural log units), in [-5, 0).
      kda_chunk_size: chunk length of the chunked KDA op.
      kda_implementation: None (best available) | "recurrent" | "chunked" | "pallas".
      moe_num_experts, moe_top_k: routed experts E and experts per token k (ffn="moe"); 1 <= k <= E, and
        k < E for the quantile methods.
      moe_d_ff: hidden width of one expert (0 = d_ff).
      moe_num_shared_experts: always-on shared experts (DeepSeekMoE).
      moe_score_func: "softmax" or "sigmoid" router scores.
      moe_routed_scaling_factor: multiplies the routed combine weights.
      moe_balancing: "none" | "aux_loss" | "seq_aux_loss" | "loss_free" | "quantile" |
        "quantile_threshold" (see `k3jax.ops.balancing`).
      moe_aux_loss_alpha: None = the method's default (1e-2 Switch, 1e-4 sequence-wise).
      moe_quantile_estimator: "exact" or "histogram" (Quantile Balancing).
      moe_histogram_bins, moe_ema: histogram bins; optional EMA of the QB bias over steps.
      moe_histogram_passes: 1 (K3) or 2 (refinement histogram inside the quantile's bin, bins² resolution).
      moe_quantile_iterations: dual steps of Quantile Balancing per training step (1 = K3; see
        `k3jax.ops.balancing.QuantileBalancing.quantile_iterations`).
      moe_capacity_factor: None = dropless; a float = capacity dispatch with token dropping.
      moe_dispatch_implementation: grouped-matmul implementation of the dropless experts (None = the
        best one tested for the call, see `k3jax.ops.grouped_matmul.grouped_matmul`; checked by the layer).
      tie_embeddings: share the embedding table with the LM head.
      init_std: std of the normal init of embeddings.
      scan_layers: run the layers as one `jax.lax.scan` over the repeats of `mixer_pattern` (one
        period of len(mixer_pattern) layers traced and compiled once; the Block AttnRes sources are
        carried as a `[N + 1, B, T, D]` buffer). Needs num_layers a multiple of len(mixer_pattern) and
        residual in ("prenorm", "block_attnres", "full_attnres"). Parameters and checkpoints are the
        same as unrolled.
      remat: rematerialisation of each scanned period in the backward pass: "none", "full" (recompute
        everything, save only the carry), or a `jax.checkpoint_policies` name ("dots_saveable",
        "dots_with_no_batch_dims_saveable": keep matmul outputs). Needs scan_layers unless "none".
    """

    vocab_size: int = 259
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    head_dim: int = 32
    mixer_pattern: str = "A"
    d_ff: int = 384
    ffn: str = "mlp"
    residual: str = "prenorm"
    residual_blocks: int = 8
    residual_block_unit: str = "sublayers"
    attention_rope: bool = True
    rope_theta: float = 10000.0
    dtype: str = "float32"
    norm_eps: float = 1e-6
    kda_gate: str = "bounded"
    kda_lower_bound: float = -5.0
    kda_chunk_size: int = 64
    kda_implementation: str | None = None
    moe_num_experts: int = 8
    moe_top_k: int = 2
    moe_d_ff: int = 0
    moe_num_shared_experts: int = 0
    moe_score_func: str = "softmax"
    moe_routed_scaling_factor: float = 1.0
    moe_balancing: str = "quantile"
    moe_aux_loss_alpha: float | None = None
    moe_quantile_estimator: str = "exact"
    moe_histogram_bins: int = 1000
    moe_histogram_passes: int = 1
    moe_quantile_iterations: int = 1
    moe_ema: float | None = None
    moe_capacity_factor: float | None = None
    moe_dispatch_implementation: str | None = None
    tie_embeddings: bool = False
    init_std: float = 0.02
    scan_layers: bool = False
    remat: str = "none"

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "head_dim", "d_ff", "kda_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{name} must be a positive int, got {value!r}")
        if not self.mixer_pattern or any(c not in MIXERS for c in self.mixer_pattern):
            raise ValueError(f"model.mixer_pattern must be letters from {sorted(MIXERS)}, got {self.mixer_pattern!r}")
        if self.ffn not in FFNS:
            raise ValueError(f"model.ffn must be one of {FFNS}, got {self.ffn!r}")
        if self.residual not in RESIDUALS:
            raise ValueError(f"model.residual must be one of {RESIDUALS}, got {self.residual!r}")
        if self.residual_block_unit not in ("sublayers", "layers"):
            raise ValueError(f"model.residual_block_unit must be 'sublayers' or 'layers', got {self.residual_block_unit!r}")
        if not isinstance(self.residual_blocks, int) or self.residual_blocks <= 0:
            raise ValueError(f"model.residual_blocks must be a positive int, got {self.residual_blocks!r}")
        if self.residual in ("block_attnres", "article_block"):
            unit = "layers" if self.residual == "article_block" else self.residual_block_unit
            units = self.num_layers if unit == "layers" else 2 * self.num_layers
            if self.residual_blocks > units:
                raise ValueError(f"model.residual_blocks={self.residual_blocks} exceeds the {units} {unit} "
                                 f"of the model (residual={self.residual!r})")
        if self.ffn == "moe":
            if not 1 <= self.moe_top_k <= self.moe_num_experts:
                raise ValueError(f"model.moe_top_k must be in [1, moe_num_experts={self.moe_num_experts}], "
                                 f"got {self.moe_top_k!r}")
            if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
                raise ValueError(f"model.moe_capacity_factor must be None or > 0, got {self.moe_capacity_factor!r}")
            self.balancing_config()
            if self.moe_balancing in ("quantile", "quantile_threshold") and self.moe_top_k >= self.moe_num_experts:
                raise ValueError(f"model.moe_top_k must be < moe_num_experts={self.moe_num_experts} for "
                                 f"moe_balancing={self.moe_balancing!r} (quantile balancing needs a (k+1)-th "
                                 f"expert per token), got {self.moe_top_k!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kda_gate not in ("bounded", "softplus"):
            raise ValueError(f"model.kda_gate must be 'bounded' or 'softplus', got {self.kda_gate!r}")
        if not -5.0 <= self.kda_lower_bound < 0.0:
            raise ValueError(f"model.kda_lower_bound must be in [-5, 0), got {self.kda_lower_bound!r}")
        if self.norm_eps <= 0:
            raise ValueError(f"model.norm_eps must be positive, got {self.norm_eps!r}")
        if self.remat not in REMAT:
            raise ValueError(f"model.remat must be one of {REMAT}, got {self.remat!r}")
        if self.remat != "none" and not self.scan_layers:
            raise ValueError(f"model.remat={self.remat!r} needs model.scan_layers=True (it applies to the scanned "
                             "period)")
        if self.scan_layers:
            if self.num_layers % len(self.mixer_pattern):
                raise ValueError(f"model.scan_layers needs model.num_layers={self.num_layers} to be a multiple of "
                                 f"len(mixer_pattern)={len(self.mixer_pattern)}")
            if self.residual not in SCAN_RESIDUALS:
                raise ValueError(f"model.scan_layers supports residual in {SCAN_RESIDUALS}, got {self.residual!r}")

    def balancing_config(self):
        """The `k3jax.ops.balancing` method config of the MoE layers (the moe_* fields it uses)."""
        from k3jax.ops.balancing import balancing_config  # noqa: PLC0415
        alpha = {} if self.moe_aux_loss_alpha is None else {"alpha": self.moe_aux_loss_alpha}
        quantile = dict(quantile_estimator=self.moe_quantile_estimator, histogram_bins=self.moe_histogram_bins,
                        ema=self.moe_ema, histogram_passes=self.moe_histogram_passes,
                        quantile_iterations=self.moe_quantile_iterations)
        options = {"aux_loss": alpha, "seq_aux_loss": alpha, "quantile": quantile}.get(self.moe_balancing, {})
        try:
            return balancing_config(self.moe_balancing, **options)
        except ValueError as e:
            fields = ("histogram_passes", "histogram_bins", "quantile_iterations", "quantile_estimator",
                      "alpha", "ema", "method")
            field = next((f for f in fields if f in str(e)), "method")
            name = {"method": "moe_balancing", "alpha": "moe_aux_loss_alpha"}.get(field, f"moe_{field}")
            raise ValueError(f"model.{name}: {e}") from e

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // 64) * 64

    @property
    def layer_mixers(self) -> tuple[str, ...]:
        """The mixer letter of each layer: `mixer_pattern` tiled to `num_layers`."""
        p = self.mixer_pattern
        return tuple(p[i % len(p)] for i in range(self.num_layers))

    @property
    def num_sublayers(self) -> int:
        return 2 * self.num_layers

    def block_layout(self):
        """The `k3jax.ops.residuals.BlockLayout` of the residual scheme (None for "prenorm")."""
        from k3jax.ops.residuals import block_layout  # noqa: PLC0415
        if self.residual == "prenorm":
            return None
        if self.residual == "full_attnres":
            return block_layout(self.num_layers, self.num_sublayers, unit="sublayers")
        if self.residual == "article_block":
            return block_layout(self.num_layers, self.residual_blocks, unit="layers")
        return block_layout(self.num_layers, self.residual_blocks, unit=self.residual_block_unit)
