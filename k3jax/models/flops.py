"""Model FLOPs per token (training: forward + backward) of a `ModelConfig`, for MFU.

Convention (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1; Chowdhery et al. 2022,
PaLM, Appendix B "Compute usage and MFU"): a matmul with a weight of P entries costs 2·P FLOPs per token
forward and 4·P backward, so training costs 6·N FLOPs per token for N matmul parameters active on that
token; sequence mixing adds its own matmuls, which PaLM counts as 12·L·H·Q·T for L attention layers of
H heads of size Q over T tokens (QKᵀ and AV, 2·2·H·Q·T forward per token, ×3 for fwd + bwd, the causal
mask NOT halving it). MFU = (FLOPs/token × tokens/s) / peak matmul rate; here the peak is the measured
dense bf16 GEMM rate of the device, so MFU is "fraction of what a large GEMM reaches".

Counted matmul parameters per layer (weights only; biases, norms, convs, gates' elementwise math,
the AttnRes depth mixes and the embedding lookup are not matmuls and are left out, as in PaLM):
  attention  qkv + output:                      4·D·H·Q
  KDA        q, k, v, output:                   4·D·H·K
             low-rank decay gate D→K→H·K:       D·K + K·H·K
             low-rank output gate D→K→H·K:      D·K + K·H·K
             beta D→H:                          D·H
  MLP        SwiGLU gate, up, down:             3·D·F
  MoE        router D·E + (top_k + shared)·3·D·F_e    (only the k routed experts a token visits count)
  LM head    D·V_pad (also when tied: the tied head is still a matmul)

KDA sequence term (the chunked algorithm that runs, Kimi Linear arXiv 2510.26692 §3 / fla
`chunk_kda`; ANCHORS.md §1), per head and token with chunk C, K = V = head_dim, forward matmuls:
  intra-chunk Aqk = Q Kᵀ and L = (β K) Kᵀ:  2·2·C·K;  W = A(β e^G K), U = A(β V):  2·C·K + 2·C·V;
  tril(Aqk) V':  2·C·V;  inter-chunk W S, Q S and the state update Kᵀ V':  3·2·K·V
  -> C·(6K + 4V) + 6·K·V forward, ×3 for training. The triangular solve for A (~C²/3 per token) and the
  elementwise decay math are left out.
"""
from __future__ import annotations

from k3jax.models.config import ModelConfig


def matmul_params_per_token(cfg: ModelConfig) -> dict[str, int]:
    """Matmul weight entries a token meets, by part (counts, not bytes).

    Args:
      cfg: the model config.
    Returns:
      {"attention": ..., "kda": ..., "ffn": ..., "head": ..., "total": ...}: weight entries summed over
      the layers of each kind; "ffn" counts only the routed experts a token visits (top_k of E) plus
      shared experts and the router, so "total" is the active (not total) parameter count N of 6·N.
    Source: module definitions in k3jax/nn/{attention,kda,mlp,moe}.py; convention of PaLM Appendix B.
    """
    d, h, q = cfg.d_model, cfg.num_heads, cfg.head_dim
    attention = kda = ffn = 0
    for letter in cfg.layer_mixers:
        if letter == "A":
            attention += 4 * d * h * q
        else:
            kda += 4 * d * h * q + 2 * (d * q + q * h * q) + d * h
        if cfg.ffn == "mlp":
            ffn += 3 * d * cfg.d_ff
        else:
            width = cfg.moe.d_ff or cfg.d_ff
            ffn += d * cfg.moe.num_experts + (cfg.moe.top_k + cfg.moe.num_shared_experts) * 3 * d * width
    head = d * cfg.padded_vocab_size
    return {"attention": attention, "kda": kda, "ffn": ffn, "head": head,
            "total": attention + kda + ffn + head}


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token (forward + backward) of `cfg` on sequences of `seq_len` tokens.

    Args:
      cfg: the model config (`kda.chunk_size` is the chunk C of the KDA term).
      seq_len: tokens per training sequence T (attention cost grows with it; packed documents are
        counted as one T-long sequence, as the dense kernel computes them).
    Returns:
      {"matmul": 6·N, "attention": 12·L_A·H·Q·T, "kda": 3·L_K·H·(C·(6K + 4V) + 6·K·V), "total": sum,
       "active_matmul_params": N} in FLOPs per token (floats).
    Raises:
      ValueError: seq_len not a positive int.
    Source: PaLM (arXiv 2204.02311) Appendix B for 6·N + 12·L·H·Q·T; the KDA term counts the matmuls of
      the chunked KDA algorithm (module docstring).
    """
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len=}")
    params = matmul_params_per_token(cfg)
    h, k = cfg.num_heads, cfg.head_dim
    num_attention = sum(1 for c in cfg.layer_mixers if c == "A")
    num_kda = cfg.num_layers - num_attention
    chunk = min(cfg.kda.chunk_size, seq_len)
    matmul = 6.0 * params["total"]
    attention = 12.0 * num_attention * h * k * seq_len
    kda = 3.0 * num_kda * h * (chunk * (6 * k + 4 * k) + 6 * k * k)
    return {"matmul": matmul, "attention": attention, "kda": kda, "total": matmul + attention + kda,
            "active_matmul_params": float(params["total"])}
