"""ModelConfig and its sub-configs: validation naming the full path, building from nested dicts, the
old flat keys refused with their new path, asdict round trips, command-line overrides."""
import dataclasses
import re

import pytest
from absl import flags
from ml_collections import config_flags

from experiments.configs import k3_tiny
from k3jax.models.config import (RENAMED, AttentionConfig, KDAConfig, ModelConfig, MoEConfig, ResidualConfig,
                                 balancing_from_dict, model_config_from_dict)
from k3jax.ops.balancing import METHODS, AuxLoss, LossFree, QuantileBalancing
from k3jax.train.config import run_config_from_dict


@pytest.mark.parametrize("build, path", [
    (lambda: ModelConfig(d_model=0), r"model\.d_model"),
    (lambda: ModelConfig(num_layers=-1), r"model\.num_layers"),
    (lambda: ModelConfig(mixer_pattern="AX"), r"model\.mixer_pattern"),
    (lambda: ModelConfig(ffn="dense"), r"model\.ffn"),
    (lambda: ModelConfig(dtype="float16"), r"model\.dtype"),
    (lambda: KDAConfig(lower_bound=-6.0), r"model\.kda\.lower_bound"),
    (lambda: KDAConfig(lower_bound=0.0), r"model\.kda\.lower_bound"),
    (lambda: KDAConfig(gate="relu"), r"model\.kda\.gate"),
    (lambda: KDAConfig(chunk_size=0), r"model\.kda\.chunk_size"),
    (lambda: KDAConfig(implementation="cuda"), r"model\.kda\.implementation"),
    (lambda: KDAConfig(conv_implementation="triton"), r"model\.kda\.conv_implementation"),
    (lambda: AttentionConfig(rope_theta=0.0), r"model\.attention\.rope_theta"),
    (lambda: AttentionConfig(rope=1), r"model\.attention\.rope"),
    (lambda: ResidualConfig(kind="postnorm"), r"model\.residual\.kind"),
    (lambda: ResidualConfig(blocks=0), r"model\.residual\.blocks"),
    (lambda: ResidualConfig(block_unit="tokens"), r"model\.residual\.block_unit"),
    (lambda: MoEConfig(num_experts=0), r"model\.moe\.num_experts"),
    (lambda: MoEConfig(top_k=True), r"model\.moe\.top_k"),
    (lambda: MoEConfig(d_ff=-1), r"model\.moe\.d_ff"),
    (lambda: MoEConfig(score_func="relu"), r"model\.moe\.score_func"),
    (lambda: MoEConfig(capacity_factor=0.0), r"model\.moe\.capacity_factor"),
    (lambda: MoEConfig(balancing="aux_loss"), r"model\.moe\.balancing"),
    (lambda: ModelConfig(moe={"top_k": 2}), r"model\.moe must be a MoEConfig"),
])
def test_bad_field_raises_naming_its_path(build, path):
    with pytest.raises(ValueError, match=path):
        build()


@pytest.mark.parametrize("residual, match", [
    (ResidualConfig(kind="block_attnres", blocks=5), r"model\.residual\.blocks=5 exceeds the 4 sublayers"),
    (ResidualConfig(kind="block_attnres", blocks=3, block_unit="layers"), r"exceeds the 2 layers"),
    (ResidualConfig(kind="article_block", blocks=3), r"exceeds the 2 layers"),
])
def test_blocks_beyond_the_model_raise(residual, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(num_layers=2, residual=residual)
    ModelConfig(num_layers=2, residual=dataclasses.replace(residual, kind="prenorm"))  # unused there


@pytest.mark.parametrize("balancing", [QuantileBalancing(), METHODS["quantile_threshold"].config()])
def test_quantile_balancing_needs_top_k_below_num_experts(balancing):
    with pytest.raises(ValueError, match=r"model\.moe\.top_k must be < model\.moe\.num_experts=4"):
        ModelConfig(ffn="moe", moe=MoEConfig(num_experts=4, top_k=4, balancing=balancing))
    ModelConfig(ffn="moe", moe=MoEConfig(num_experts=4, top_k=4, balancing=AuxLoss()))  # fine without QB
    ModelConfig(ffn="moe", moe=MoEConfig(num_experts=4, top_k=3, balancing=balancing))
    ModelConfig(ffn="mlp", moe=MoEConfig(num_experts=4, top_k=4, balancing=balancing))  # no MoE layers


def test_nested_dict_builds_every_part():
    cfg = model_config_from_dict({
        "d_model": 64, "ffn": "moe", "mixer_pattern": "KA",
        "kda": {"lower_bound": -3.0, "gate": "softplus"}, "attention": {"rope": False},
        "residual": {"kind": "full_attnres"},
        "moe": {"num_experts": 6, "top_k": 3, "balancing": {"method": "aux_loss", "alpha": 0.05}}})
    assert cfg.kda == KDAConfig(gate="softplus", lower_bound=-3.0)
    assert cfg.attention == AttentionConfig(rope=False)
    assert cfg.residual.kind == "full_attnres"
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.balancing) == (6, 3, AuxLoss(alpha=0.05))
    assert model_config_from_dict({}) == ModelConfig()
    assert model_config_from_dict({"moe": {"balancing": {}}}).moe.balancing == QuantileBalancing()


@pytest.mark.parametrize("cfg", [
    ModelConfig(),
    ModelConfig(ffn="moe", mixer_pattern="KKKA", num_layers=8, kda=KDAConfig(implementation="chunked"),
                residual=ResidualConfig(kind="block_attnres", blocks=4),
                moe=MoEConfig(num_experts=16, capacity_factor=1.25, balancing=LossFree(gamma=1e-2))),
    *[ModelConfig(ffn="moe", moe=MoEConfig(balancing=row.config())) for row in METHODS.values()],
])
def test_asdict_round_trip(cfg):
    d = dataclasses.asdict(cfg)
    assert d["moe"]["balancing"]["method"] == cfg.moe.balancing.method  # the method is kept in the dict
    assert model_config_from_dict(d) == cfg


@pytest.mark.parametrize("old", sorted(set(RENAMED) - {"residual"}))  # residual: a section now, below
def test_flat_old_key_raises_naming_its_new_path(old):
    with pytest.raises(ValueError, match=re.escape(f"model.{old} -> model.{RENAMED[old]}")):
        model_config_from_dict({old: None})


def test_unknown_keys_and_flat_residual_string_raise():
    with pytest.raises(ValueError, match=r"model: unknown field\(s\) \['d_modle'\]"):
        model_config_from_dict({"d_modle": 64})
    with pytest.raises(ValueError, match=r"model\.kda: unknown field\(s\) \['lower'\]"):
        model_config_from_dict({"kda": {"lower": -3.0}})
    with pytest.raises(ValueError, match=r"model\.residual must be a dict .*now model\.residual\.kind"):
        model_config_from_dict({"residual": "prenorm"})


def test_balancing_options_of_another_method_raise():
    with pytest.raises(ValueError, match=r"model\.moe\.balancing\.method='aux_loss' takes the options"):
        balancing_from_dict({"method": "aux_loss", "gamma": 1e-3})
    with pytest.raises(ValueError, match=r"model\.moe\.balancing\.method must be one of"):
        balancing_from_dict({"method": "switch"})
    with pytest.raises(ValueError, match=r"model\.moe\.balancing\.alpha"):
        balancing_from_dict({"method": "aux_loss", "alpha": -1.0})
    # None = the method's default (how a config file holds the options of the methods it does not use)
    assert balancing_from_dict({"method": "aux_loss", "alpha": None, "gamma": None}) == AuxLoss()


def _parse(args):
    """The run config of k3_tiny.py with `args`, parsed as `make train ARGS=...` does (absl + ml_collections)."""
    argv = ["prog", *args]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", default=k3_tiny.__file__, flag_values=fv, sys_argv=argv)
    fv(argv)
    return run_config_from_dict(fv.config)


def test_command_line_overrides_reach_the_nested_fields():
    cfg = _parse(["--config.model.kda.lower_bound=-3", "--config.model.residual.kind=prenorm",
                  "--config.model.moe.top_k=1", "--config.model.moe.capacity_factor=1.25",
                  "--config.model.moe.balancing.method=aux_loss", "--config.model.moe.balancing.alpha=0.05",
                  "--config.model.attention.rope=false"])
    m = cfg.model
    assert (m.kda.lower_bound, m.residual.kind, m.moe.top_k, m.moe.capacity_factor) == (-3.0, "prenorm", 1, 1.25)
    assert m.moe.balancing == AuxLoss(alpha=0.05) and m.attention.rope is False
    assert _parse([]).model == run_config_from_dict(k3_tiny.get_config()).model
    with pytest.raises(ValueError, match=r"model\.moe\.balancing\.method='quantile' takes the options"):
        _parse(["--config.model.moe.balancing.gamma=0.01"])  # an option of loss_free under QB
    with pytest.raises(Exception, match="moe_top_k"):  # the old flat override is not a field any more
        _parse(["--config.model.moe_top_k=1"])


def test_renamed_command_line_override_names_the_new_path():
    from experiments.configs.common import check_renamed_overrides  # noqa: PLC0415
    with pytest.raises(ValueError, match=re.escape("use --config.model.moe.top_k")):
        check_renamed_overrides(["prog", "--config.model.moe_top_k=4"])
    with pytest.raises(ValueError, match=re.escape("use --k3_config.model.residual.kind")):
        check_renamed_overrides(["prog", "--k3_config.model.residual=prenorm"])
    check_renamed_overrides(["prog", "--config.model.residual.kind=prenorm", "--config.model.moe.top_k=4",
                             "--config.train.steps=3"])
