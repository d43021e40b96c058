"""Model FLOPs per token (k3jax.models.flops): the hand count, the parameter count against the model."""
import numpy as np
import pytest
from flax import nnx

from k3jax.models.config import ModelConfig, MoEConfig
from k3jax.models.flops import matmul_params_per_token, model_flops_per_token
from k3jax.models.lm import LanguageModel
from k3jax.train.config import run_config_from_dict

TINY_HYBRID = ModelConfig(d_model=8, num_layers=2, num_heads=2, head_dim=4, mixer_pattern="KA", ffn="moe",
                          moe=MoEConfig(num_experts=4, top_k=2, d_ff=6))


def test_flops_hand_count():
    # KDA layer: q,k,v,o 4*8*8 = 256; decay gate 8*4 + 4*8 = 64; output gate 64; beta 8*2 = 16 -> 400.
    # attention layer: qkv + o = 4*8*8 = 256. MoE layer: router 8*4 + top-2 * 3*8*6 = 32 + 288 = 320.
    # head: 8 * 320 (vocab 259 padded to 320).
    params = matmul_params_per_token(TINY_HYBRID)
    assert params == {"attention": 256, "kda": 400, "ffn": 640, "head": 2560, "total": 3856}
    flops = model_flops_per_token(TINY_HYBRID, 32)
    assert flops["matmul"] == 6 * 3856
    assert flops["attention"] == 12 * 1 * 2 * 4 * 32              # 12 L H Q T
    assert flops["kda"] == 3 * 1 * 2 * (32 * (6 * 4 + 4 * 4) + 6 * 4 * 4)   # chunk = min(64, T) = 32
    assert flops["total"] == 6 * 3856 + 3072 + 8256


@pytest.mark.parametrize("cfg", [
    ModelConfig(d_model=16, num_layers=2, num_heads=2, head_dim=8, mixer_pattern="A", d_ff=24),
    ModelConfig(d_model=16, num_layers=2, num_heads=2, head_dim=8, mixer_pattern="KA", ffn="moe",
                moe=MoEConfig(num_experts=4, top_k=2, d_ff=12, num_shared_experts=1)),
], ids=["dense", "hybrid_moe"])
def test_flops_params_match_the_model(cfg):
    """Active matmul params from the formula == the instantiated model's matmul weights (routed experts
    scaled by top_k / E), so the formula tracks the modules."""
    model = nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))
    total = 0.0
    for names, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        p = variable.get_value()  # a ShapeDtypeStruct: no parameters are materialised
        if names[-1] == "kernel" and "embed" not in names:
            total += int(np.prod(p.shape))
        elif names[-1] in ("router", "shared_gate", "shared_up", "shared_down"):
            total += int(np.prod(p.shape))
        elif names[-1] in ("w_gate", "w_up", "w_down"):
            total += int(np.prod(p.shape)) * cfg.moe.top_k / cfg.moe.num_experts
    assert total == matmul_params_per_token(cfg)["total"]


def test_flops_rejects_bad_seq_len():
    with pytest.raises(ValueError, match="seq_len"):
        model_flops_per_token(TINY_HYBRID, 0)
