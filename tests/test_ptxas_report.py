"""experiments/ptxas_report.py: its --kernels entries are checked before anything compiles (the
report itself needs a GPU: ptxas runs when XLA compiles a Mosaic GPU kernel)."""
import pytest

from experiments import ptxas_report


def test_parse_spec():
    assert ptxas_report.parse_spec("intra_bwd_a_hopper") == ("intra_bwd_a_hopper", ())
    assert ptxas_report.parse_spec("intra_bwd_a_hopper:dL+input_copies") == ("intra_bwd_a_hopper", ("dL", "input_copies"))
    with pytest.raises(ValueError, match="intra_bwd_a'"):                 # a Triton kernel: no ptxas report
        ptxas_report.parse_spec("intra_bwd_a")
    with pytest.raises(ValueError, match="unknown ablations"):
        ptxas_report.parse_spec("intra_bwd_b_hopper:dL")
