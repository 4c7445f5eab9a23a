"""Entry point of the Stage-III trainer.

    python -m verl_omni.trainer.main_stage3 --config-path DIR --config-name NAME [key=value ...]

Composes the recipe's Hydra config (Hydra's compose API: no working-directory change and no Hydra output
directories, since all outputs belong under ``trainer.output_dir``), resolves its topology targets into exact
batch sizes (:func:`~verl_omni.trainer.topology.resolve_config_topology`, the function the contract check
calls too) and prints them, validates the result into :class:`~verl_omni.trainer.config.Stage3Config` and runs
:class:`~verl_omni.trainer.ray_trainer.Stage3Trainer`. Users launch it through
``recipes/wnm_3d/stage3/launch.sh``, which validates the contract first.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path


def compose_config(config_dir: str | Path, config_name: str, overrides: list[str]):
    """Composes a Hydra config from ``config_dir/config_name.yaml`` with ``overrides``."""
    from hydra import compose, initialize_config_dir

    config_dir = Path(config_dir).resolve()
    if not (config_dir / f"{config_name}.yaml").is_file():
        raise FileNotFoundError(f"{config_dir / (config_name + '.yaml')}: recipe config not found")
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=config_name, overrides=overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-path", required=True, help="directory of the recipe's Hydra YAML files")
    parser.add_argument("--config-name", required=True, help="top-level config name (without .yaml)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides key=value (launch.sh passes only its own)")
    args = parser.parse_args(argv)

    from omegaconf import OmegaConf

    from verl_omni.trainer.config import ConfigError, trainer_config_from_dict
    from verl_omni.trainer.ray_trainer import run
    from verl_omni.trainer.topology import resolve_config_topology

    try:
        raw = compose_config(args.config_path, args.config_name, args.overrides)
        tree = OmegaConf.to_container(raw, resolve=True)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # Hydra/OmegaConf errors (missing env var, bad override) are user errors here
        print(f"error: cannot compose the trainer config: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    try:
        snapshot, plan = resolve_config_topology(tree)
        print(plan.describe(), flush=True)  # the batch sizes this run really uses
        cfg = trainer_config_from_dict(copy.deepcopy(snapshot))
    except (ConfigError, TypeError, ValueError) as e:  # TopologyError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run(cfg, snapshot)


if __name__ == "__main__":
    sys.exit(main())
