"""Train a k3jax language model.

  python -m experiments.train --config=experiments/configs/k3_tiny.py --config.train.steps=50

Outputs go to `--config.workdir`: checkpoints/, metrics.jsonl, tensorboard/, run_header.json.
Re-running with the same workdir resumes from the latest checkpoint.
"""
from absl import app, flags, logging

from experiments.configs.common import define_config_file
from k3jax.train.config import run_config_from_dict
from k3jax.train.trainer import train

_CONFIG = define_config_file("config", "experiments/configs/k3_tiny.py", "Run config file.")


def main(argv):
    del argv
    if logging.get_verbosity() == logging.INFO and not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO; --verbosity=0 brings it back
    train(run_config_from_dict(_CONFIG.value))


if __name__ == "__main__":
    app.run(main)
