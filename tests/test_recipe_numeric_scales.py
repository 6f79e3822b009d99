"""A field that is a name or a number (``dense_scaling``: "standard", "mup" or a number > 0)
reaches the model config as a number from the command line and from a config file, and a bad value is still a
one-line error naming the field."""

import pytest

from hf_structattn.training import icl
from hf_structattn.training.args import ConfigError, parse_recipe_args


def _model(argv) -> dict:
    return parse_recipe_args(icl.ICLArgs, icl.ICLModelArgs, argv).model  # the model config was built and checked


def test_numeric_dense_scaling_from_the_command_line_and_a_config_file(tmp_path):
    assert _model(["--dense_scaling", "0.0625", "--output_dir", str(tmp_path / "a")])["dense_scaling"] == 0.0625
    assert _model(["--dense_scaling", "mup", "--output_dir", str(tmp_path / "b")])["dense_scaling"] == "mup"
    config = tmp_path / "run.yaml"
    config.write_text(f"output_dir: {tmp_path / 'c'}\nmodel:\n  dense_scaling: 0.0625\n  bilinear_scaling: mup\n")
    model = _model(["--config", str(config)])
    assert model["dense_scaling"] == 0.0625 and model["bilinear_scaling"] == "mup"  # a name-only field stays a name
    with pytest.raises(ConfigError, match="dense_scaling='nope' is not one of"):
        _model(["--dense_scaling", "nope", "--output_dir", str(tmp_path / "d")])
    with pytest.raises(ConfigError, match="dense_scaling=-1.0 must be 'standard', 'mup' or a finite number > 0"):
        _model(["--dense_scaling=-1", "--output_dir", str(tmp_path / "e")])
