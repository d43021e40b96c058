"""Model configuration: frozen dataclasses validated at construction, one sub-config per part.

The layer stack is described by `mixer_pattern`, one letter per layer, repeated to `num_layers`:
``"A"`` = causal softmax attention, ``"K"`` = Kimi Delta Attention. ``ffn`` picks the feed-forward
(``"mlp"`` = SwiGLU, ``"moe"`` = routed experts). The parts live in sub-configs: ``model.kda``
(:class:`KDAConfig`), ``model.attention`` (:class:`AttentionConfig`), ``model.residual``
(:class:`ResidualConfig`) and ``model.moe`` (:class:`MoEConfig`, whose ``balancing`` is a
`k3jax.ops.balancing` method config). Each sub-config checks its own fields; checks that need two parts
(blocks vs layers, top_k vs experts for Quantile Balancing, scan_layers vs residual) are in
:class:`ModelConfig`. :func:`model_config_from_dict` builds one from a nested dict (docs/config.md).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from k3jax.ops.balancing import METHODS, BalancingMethod, QuantileBalancing

MIXERS = {"A": "attention", "K": "kda"}
FFNS = ("mlp", "moe")
RESIDUALS = ("prenorm", "block_attnres", "full_attnres", "article_block")
DTYPES = ("float32", "bfloat16")
REMAT = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
SCAN_RESIDUALS = ("prenorm", "block_attnres", "full_attnres")
KDA_GATES = ("bounded", "softplus")
KDA_IMPLEMENTATIONS = (None, "recurrent", "chunked", "pallas")
KDA_CONV_IMPLEMENTATIONS = (None, "xla", "jla")
SCORE_FUNCS = ("softmax", "sigmoid")
ATTENTION_IMPLEMENTATIONS = (None, "xla", "pallas_triton", "cudnn", "jla")
DEPTH_IMPLEMENTATIONS = (None, "xla", "pallas")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention mixers (``"K"`` in `mixer_pattern`), at ``model.kda``.

    Attributes:
      gate: "bounded" (lower_bound * sigmoid, K3) or "softplus" (Kimi Linear).
      lower_bound: lower bound of the bounded log-decay gate (natural log units), in [-5, 0).
      chunk_size: chunk length of the chunked KDA op.
      implementation: None (best available) | "recurrent" | "chunked" | "pallas".
      conv_implementation: the q/k/v short conv: None (jla's fused Mosaic GPU kernels where they take
        the call, else XLA) | "xla" | "jla" (see `k3jax.nn.kda.KimiDeltaAttention`).
    """

    gate: str = "bounded"
    lower_bound: float = -5.0
    chunk_size: int = 64
    implementation: str | None = None
    conv_implementation: str | None = None

    def __post_init__(self):
        if self.gate not in KDA_GATES:
            raise ValueError(f"model.kda.gate must be one of {KDA_GATES}, got {self.gate!r}")
        if not -5.0 <= self.lower_bound < 0.0:
            raise ValueError(f"model.kda.lower_bound must be in [-5, 0), got {self.lower_bound!r}")
        if not _positive_int(self.chunk_size):
            raise ValueError(f"model.kda.chunk_size must be a positive int, got {self.chunk_size!r}")
        if self.implementation not in KDA_IMPLEMENTATIONS:
            raise ValueError(f"model.kda.implementation must be one of {KDA_IMPLEMENTATIONS}, "
                             f"got {self.implementation!r}")
        if self.conv_implementation not in KDA_CONV_IMPLEMENTATIONS:
            raise ValueError(f"model.kda.conv_implementation must be one of {KDA_CONV_IMPLEMENTATIONS}, "
                             f"got {self.conv_implementation!r}")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Causal softmax attention mixers (``"A"`` in `mixer_pattern`), at ``model.attention``.

    Attributes:
      rope: rotary position embedding (False = NoPE, as K3's hybrid).
      rope_theta: RoPE base (> 0).
      implementation: None (the fastest supported: jla's Mosaic GPU flash attention on an H100/H200
        with jla installed, else cuDNN flash attention on a CUDA GPU, XLA elsewhere) | "xla" |
        "pallas_triton" | "cudnn" | "jla" (`k3jax.ops.attention.causal_attention`).
    """

    rope: bool = True
    rope_theta: float = 10000.0
    implementation: str | None = None

    def __post_init__(self):
        if not isinstance(self.rope, bool):
            raise ValueError(f"model.attention.rope must be a bool, got {self.rope!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"model.attention.rope_theta must be positive, got {self.rope_theta!r}")
        if self.implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"model.attention.implementation must be one of {ATTENTION_IMPLEMENTATIONS}, "
                             f"got {self.implementation!r}")


@dataclasses.dataclass(frozen=True)
class ResidualConfig:
    """The residual scheme, at ``model.residual``.

    Attributes:
      kind: "prenorm" (plain PreNorm residual stream) | "block_attnres" (Block Attention Residuals,
        arXiv 2603.15031: each sublayer reads a softmax mix over [embedding, block sums, partial sum]) |
        "full_attnres" (N = L: every sublayer output is its own source) | "article_block" (the seed
        article's literal version: alpha-scaled attention output replaces the stream at block ends).
      blocks: N, the number of blocks for "block_attnres" and "article_block" (at most the number of
        units, checked by `ModelConfig`).
      block_unit: what "block_attnres" blocks count: "sublayers" (paper) or "layers" (K3).
        "article_block" always groups whole layers.
      implementation: of the AttnRes depth mixes: None (the Pallas kernels on an H100/H200, XLA
        elsewhere) | "xla" | "pallas" (`k3jax.ops.residuals.depth_attention`).
    """

    kind: str = "prenorm"
    blocks: int = 8
    block_unit: str = "sublayers"
    implementation: str | None = None

    def __post_init__(self):
        if self.kind not in RESIDUALS:
            raise ValueError(f"model.residual.kind must be one of {RESIDUALS}, got {self.kind!r}")
        if not _positive_int(self.blocks):
            raise ValueError(f"model.residual.blocks must be a positive int, got {self.blocks!r}")
        if self.block_unit not in ("sublayers", "layers"):
            raise ValueError(f"model.residual.block_unit must be 'sublayers' or 'layers', got {self.block_unit!r}")
        if self.implementation not in DEPTH_IMPLEMENTATIONS:
            raise ValueError(f"model.residual.implementation must be one of {DEPTH_IMPLEMENTATIONS}, "
                             f"got {self.implementation!r}")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Routed experts (``ffn="moe"``), at ``model.moe``.

    Attributes:
      num_experts, top_k: routed experts E and experts per token k; 1 <= k <= E, and k < E for the
        quantile methods (checked by `ModelConfig` when ffn="moe").
      d_ff: hidden width of one expert (0 = model.d_ff).
      num_shared_experts: always-on shared experts (DeepSeekMoE).
      score_func: "softmax" or "sigmoid" router scores.
      routed_scaling_factor: multiplies the routed combine weights.
      capacity_factor: None = dropless; a float > 0 = capacity dispatch with token dropping.
      dispatch_implementation: grouped-matmul implementation of the dropless experts (None = the best
        one tested for the call, see `k3jax.ops.grouped_matmul.grouped_matmul`; checked by the layer).
      balancing: a `k3jax.ops.balancing` method config (`METHODS`), which validates its own fields; in a
        dict ``{"method": "aux_loss", "alpha": 0.01}`` (``model.moe.balancing.method`` and the method's
        options, see `model_config_from_dict`). Default: Quantile Balancing, exact quantile (K3).
    """

    num_experts: int = 8
    top_k: int = 2
    d_ff: int = 0
    num_shared_experts: int = 0
    score_func: str = "softmax"
    routed_scaling_factor: float = 1.0
    capacity_factor: float | None = None
    dispatch_implementation: str | None = None
    balancing: BalancingMethod = QuantileBalancing()

    def __post_init__(self):
        for name in ("num_experts", "top_k"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"model.moe.{name} must be a positive int, got {getattr(self, name)!r}")
        for name in ("d_ff", "num_shared_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"model.moe.{name} must be a non-negative int, got {value!r}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"model.moe.score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"model.moe.capacity_factor must be None or > 0, got {self.capacity_factor!r}")
        row = METHODS.get(getattr(self.balancing, "method", None))
        if row is None or not isinstance(self.balancing, row.config):
            raise ValueError(f"model.moe.balancing must be a k3jax.ops.balancing config "
                             f"({[m.config.__name__ for m in METHODS.values()]}), got {self.balancing!r}")


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
      d_ff: SwiGLU hidden size (per expert for MoE unless moe.d_ff is set).
      ffn: "mlp" or "moe".
      dtype: compute dtype ("bfloat16" or "float32"); parameters are always float32.
      norm_eps: RMSNorm epsilon.
      tie_embeddings: share the embedding table with the LM head.
      init_std: std of the normal init of embeddings.
      scan_layers: run the layers as one `jax.lax.scan` over the repeats of `mixer_pattern` (one
        period of len(mixer_pattern) layers traced and compiled once; the Block AttnRes sources are
        carried as a `[N + 1, B, T, D]` buffer). Needs num_layers a multiple of len(mixer_pattern) and
        residual.kind in ("prenorm", "block_attnres", "full_attnres"). Parameters and checkpoints are
        the same as unrolled.
      remat: rematerialisation of each scanned period in the backward pass: "none", "full" (recompute
        everything, save only the carry; with AttnRes not even that: `residuals.scan_source_buffer`), or a
        `jax.checkpoint_policies` name ("dots_saveable", "dots_with_no_batch_dims_saveable": keep matmul outputs). Needs scan_layers unless "none".
      kda, attention, residual, moe: the sub-configs (:class:`KDAConfig`, :class:`AttentionConfig`,
        :class:`ResidualConfig`, :class:`MoEConfig`).
    """

    vocab_size: int = 259
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    head_dim: int = 32
    mixer_pattern: str = "A"
    d_ff: int = 384
    ffn: str = "mlp"
    dtype: str = "float32"
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    scan_layers: bool = False
    remat: str = "none"
    kda: KDAConfig = KDAConfig()
    attention: AttentionConfig = AttentionConfig()
    residual: ResidualConfig = ResidualConfig()
    moe: MoEConfig = MoEConfig()

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "head_dim", "d_ff"):
            value = getattr(self, name)
            if not _positive_int(value):
                raise ValueError(f"model.{name} must be a positive int, got {value!r}")
        for name, cls in (("kda", KDAConfig), ("attention", AttentionConfig), ("residual", ResidualConfig),
                          ("moe", MoEConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"model.{name} must be a {cls.__name__}, got {getattr(self, name)!r} "
                                 "(docs/config.md: the flat fields moved into sub-configs)")
        if not self.mixer_pattern or any(c not in MIXERS for c in self.mixer_pattern):
            raise ValueError(f"model.mixer_pattern must be letters from {sorted(MIXERS)}, got {self.mixer_pattern!r}")
        if self.ffn not in FFNS:
            raise ValueError(f"model.ffn must be one of {FFNS}, got {self.ffn!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.norm_eps <= 0:
            raise ValueError(f"model.norm_eps must be positive, got {self.norm_eps!r}")
        if self.remat not in REMAT:
            raise ValueError(f"model.remat must be one of {REMAT}, got {self.remat!r}")
        # Cross-part checks.
        res = self.residual
        if res.kind in ("block_attnres", "article_block"):
            unit = "layers" if res.kind == "article_block" else res.block_unit
            units = self.num_layers if unit == "layers" else 2 * self.num_layers
            if res.blocks > units:
                raise ValueError(f"model.residual.blocks={res.blocks} exceeds the {units} {unit} "
                                 f"of the model (model.residual.kind={res.kind!r})")
        if self.ffn == "moe":
            moe = self.moe
            if moe.top_k > moe.num_experts:
                raise ValueError(f"model.moe.top_k must be in [1, model.moe.num_experts={moe.num_experts}], "
                                 f"got {moe.top_k!r}")
            if moe.balancing.method in ("quantile", "quantile_threshold") and moe.top_k >= moe.num_experts:
                raise ValueError(f"model.moe.top_k must be < model.moe.num_experts={moe.num_experts} for "
                                 f"model.moe.balancing.method={moe.balancing.method!r} (quantile balancing needs "
                                 f"a (k+1)-th expert per token), got {moe.top_k!r}")
        if self.remat != "none" and not self.scan_layers:
            raise ValueError(f"model.remat={self.remat!r} needs model.scan_layers=True (it applies to the scanned "
                             "period)")
        if self.scan_layers:
            if self.num_layers % len(self.mixer_pattern):
                raise ValueError(f"model.scan_layers needs model.num_layers={self.num_layers} to be a multiple of "
                                 f"len(mixer_pattern)={len(self.mixer_pattern)}")
            if res.kind not in SCAN_RESIDUALS:
                raise ValueError(f"model.scan_layers supports model.residual.kind in {SCAN_RESIDUALS}, "
                                 f"got {res.kind!r}")

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
        kind, blocks = self.residual.kind, self.residual.blocks
        if kind == "prenorm":
            return None
        if kind == "full_attnres":
            return block_layout(self.num_layers, self.num_sublayers, unit="sublayers")
        if kind == "article_block":
            return block_layout(self.num_layers, blocks, unit="layers")
        return block_layout(self.num_layers, blocks, unit=self.residual.block_unit)


# ----------------------------------------------------------------------------------------------
# Building from (nested) dicts: run_config_from_dict, run_header.json, ml_collections configs.
# ----------------------------------------------------------------------------------------------

# The flat ModelConfig fields before the sub-configs (old key -> new path under model.).
RENAMED = {
    "residual": "residual.kind",
    "residual_blocks": "residual.blocks",
    "residual_block_unit": "residual.block_unit",
    "attention_rope": "attention.rope",
    "rope_theta": "attention.rope_theta",
    "kda_gate": "kda.gate",
    "kda_lower_bound": "kda.lower_bound",
    "kda_chunk_size": "kda.chunk_size",
    "kda_implementation": "kda.implementation",
    "moe_num_experts": "moe.num_experts",
    "moe_top_k": "moe.top_k",
    "moe_d_ff": "moe.d_ff",
    "moe_num_shared_experts": "moe.num_shared_experts",
    "moe_score_func": "moe.score_func",
    "moe_routed_scaling_factor": "moe.routed_scaling_factor",
    "moe_capacity_factor": "moe.capacity_factor",
    "moe_dispatch_implementation": "moe.dispatch_implementation",
    "moe_balancing": "moe.balancing.method",
    "moe_aux_loss_alpha": "moe.balancing.alpha",
    "moe_quantile_estimator": "moe.balancing.quantile_estimator",
    "moe_histogram_bins": "moe.balancing.histogram_bins",
    "moe_histogram_passes": "moe.balancing.histogram_passes",
    "moe_quantile_iterations": "moe.balancing.quantile_iterations",
    "moe_ema": "moe.balancing.ema",
}


def _check_keys(cls, path: str, values: Mapping[str, Any], renamed: Mapping[str, str] = {}) -> None:
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - fields)
    moved = [k for k in unknown if k in renamed]
    if moved:
        pairs = ", ".join(f"{path}.{k} -> {path}.{renamed[k]}" for k in moved)
        raise ValueError(f"{path}: flat key(s) {moved} moved into sub-configs: {pairs} (docs/config.md)")
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {unknown}; known: {sorted(fields)}")


def _section(path: str, value) -> dict:
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if not isinstance(value, Mapping):
        hint = {"model.residual": " (was model.residual=<kind>: now model.residual.kind)"}.get(path, "")
        raise ValueError(f"{path} must be a dict of its fields, got {value!r}{hint}")
    return dict(value)


def balancing_from_dict(values: Mapping[str, Any], path: str = "model.moe.balancing") -> BalancingMethod:
    """The `k3jax.ops.balancing` config of ``{"method": name, **options}`` (method default "quantile").

    Options that are None are dropped, i.e. take the method's default (how an ml_collections config holds
    the options of the methods it does not use, see experiments/configs/common.py). Any other option the
    method does not have raises, so a setting never goes unused.

    Raises:
      ValueError: unknown method, an option of another method, or a bad value; the message names
        ``{path}.<field>``.
    """
    values = _section(path, values)
    method = values.pop("method", QuantileBalancing.method)
    if method not in METHODS:
        raise ValueError(f"{path}.method must be one of {tuple(METHODS)}, got {method!r}")
    cls = METHODS[method].config
    options = {k: v for k, v in values.items() if v is not None}
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"{path}: {path}.method={method!r} takes the options {sorted(fields)}; got "
                         f"{[f'{path}.{k}' for k in unknown]}")
    try:
        return cls(**options)
    except ValueError as e:
        field = next((f for f in sorted(fields, key=len, reverse=True) if str(e).startswith(f)), None)
        raise ValueError(f"{path}.{e}" if field else f"{path}: {e}") from e


def model_config_from_dict(values: Mapping[str, Any], path: str = "model") -> ModelConfig:
    """Build a `ModelConfig` from a nested dict (or ConfigDict), e.g. ``dataclasses.asdict(cfg)``.

    ``{"d_model": 256, "kda": {"lower_bound": -3.0}, "residual": {"kind": "prenorm"},
    "moe": {"top_k": 4, "balancing": {"method": "aux_loss", "alpha": 0.01}}}``; missing fields take
    their defaults. A flat key of the older config (``moe_top_k``, ``residual="prenorm"``, ...) is NOT
    mapped: it raises a ValueError naming its new path (`RENAMED`, docs/config.md), as does any unknown
    key.
    """
    values = _section(path, values)
    _check_keys(ModelConfig, path, values, RENAMED)
    for name, cls in (("kda", KDAConfig), ("attention", AttentionConfig), ("residual", ResidualConfig)):
        if name in values:
            sub = _section(f"{path}.{name}", values[name])
            _check_keys(cls, f"{path}.{name}", sub)
            values[name] = cls(**sub)
    if "moe" in values:
        sub = _section(f"{path}.moe", values["moe"])
        _check_keys(MoEConfig, f"{path}.moe", sub)
        if "balancing" in sub:
            sub["balancing"] = balancing_from_dict(sub["balancing"], f"{path}.moe.balancing")
        values["moe"] = MoEConfig(**sub)
    return ModelConfig(**values)
