"""Fail-closed contract check of the official Stage-III recipe (the Python behind ``validate.sh``).

``validate.sh`` loads ``paths.env`` into the environment and runs::

    python -m verl_omni.trainer.contract_check --config-dir recipes/wnm_3d/stage3/config [--paths-env FILE]

Checks, in order (docs/design.md, "Launch"), each failure naming the variable or file and what to do:

1. environment (:mod:`.contract_env`): every required variable set, paths exist, integers and enumerations
   valid, multi-node and network-interface settings consistent;
2. checkpoints (:mod:`.contract_data`): both are readable WNM checkpoints, contract-compatible with each other
   (the one shared rule, ``check_contract_compatibility``), frozen-part sources resolvable;
3. data (:mod:`.contract_data`): training manifest (kind, provenance, ``counts.skipped == 0``, exact row count,
   shard hashes, contract vs both checkpoints), validation manifest (rows >= ``WAM_VAL_MAX_SAMPLES``, no
   episode shared with training), every referenced video present and long enough, every occupancy scene present;
4. configuration (here): the Hydra recipe composes, its locked constants equal the recipe's
   (:mod:`.locked_recipe`), the topology resolves (:mod:`verl_omni.trainer.topology`), the whole tree
   validates as ``Stage3Config`` and the initial checkpoint is of its ``model.variant``.

``STAGE3_CONFIG_CONTRACT_OK`` is printed only when everything passes (exit code 0; 1 otherwise). Nothing
is written, no Ray is started, no GPU is allocated; ``--write-plan DIR`` (used by ``launch.sh`` after a
successful check) additionally writes the resolved config snapshot and the topology into a new directory, as
records: the driver resolves the topology itself from the same recipe (``resolve_config_topology``).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from verl_omni.trainer import launch_env
from verl_omni.trainer.contract_data import check_checkpoints, check_data
from verl_omni.trainer.contract_env import Report, Settings, check_environment
from verl_omni.trainer.locked_recipe import (
    LOCKED_FILE,
    canonical_problems,
    locked_constant_problems,
    read_locked_file,
    recipe_name,
)

OK_TOKEN = "STAGE3_CONFIG_CONTRACT_OK"
CONFIG_NAME = "stage3"


@dataclass
class Plan:
    """What a successful check records for launch.sh's config snapshot (the driver resolves the same itself).

    Attributes:
        resolved: The composed recipe with its topology resolved.
        topology_text: :meth:`~verl_omni.trainer.topology.TopologyPlan.describe` of it.
    """

    resolved: dict
    topology_text: str


def check_run_provenance(s: Settings, plan: Plan, report: Report, env: Mapping[str, str]) -> None:
    """The same checks the driver makes on relaunch into WAM_OUTPUT_DIR: provenance and checkpoint integrity."""
    from verl_omni.trainer import checkpointing
    from verl_omni.trainer.config import trainer_config_from_dict

    out = s.output_dir
    if out is None or not out.is_dir():
        return
    cfg = trainer_config_from_dict(copy.deepcopy(plan.resolved))
    try:
        result = checkpointing.check_provenance(out, checkpointing.run_provenance(cfg.to_dict()), env)
    except checkpointing.ProvenanceError as e:
        report.fail("WAM_OUTPUT_DIR", f"WAM_OUTPUT_DIR={out}: {e}")
        return
    for msg in result.messages:
        report.note(msg)
    if cfg.trainer.resume == "never":
        return
    try:
        choice = checkpointing.choose_resume(out)
    except checkpointing.CheckpointIntegrityError as e:
        report.fail("WAM_OUTPUT_DIR", f"WAM_OUTPUT_DIR={out}: {e}")
        return
    if choice.step is None:
        report.ok(f"run directory: {out} holds no checkpoint; a new run starts")
        return
    foreign = checkpointing.foreign_checkpoint_problem(out, choice.step, choice.path)
    if foreign:
        report.fail("WAM_OUTPUT_DIR", f"WAM_OUTPUT_DIR={out}: {foreign}")
        return
    if choice.fell_back:
        report.note(
            f"WAM_OUTPUT_DIR: newer checkpoint(s) are damaged and will not be used:\n{choice.describe_damage()}\n"
            f"  the run resumes from the newest intact checkpoint {choice.path}"
        )
    report.ok(f"run directory: provenance matches; resumes from verified checkpoint {choice.path}")


def locked_file_problems(locked_path: Path) -> list[str]:
    """A recipe's ``locked.yaml`` against the locked constants, and the repository's own file against its
    published fingerprint (an in-place edit of the repository's file shows only there)."""
    return canonical_problems() + locked_constant_problems(read_locked_file(locked_path), str(locked_path))


def variant_matches(s: Settings, variant: str, locked_path: Path, report: Report) -> bool:
    """The initial checkpoint is of the recipe's ``model.variant`` (the check the driver and workers make too)."""
    from verl_omni.contracts import CheckpointError, VariantMismatchError, check_checkpoint_variant

    init_path = s.paths.get("WNM3D_INITIAL_CHECKPOINT")
    if init_path is None:
        return True
    try:
        check_checkpoint_variant(
            init_path,
            variant,
            f"model.variant (in {locked_path})",
            remedy=f"recipe {recipe_name()} trains {variant} checkpoints; start from a {variant} checkpoint",
        )
    except VariantMismatchError as e:
        report.fail("WNM3D_INITIAL_CHECKPOINT", f"WNM3D_INITIAL_CHECKPOINT={init_path}: {e}")
        return False
    except CheckpointError:
        return True  # an unreadable checkpoint is reported by check_checkpoints
    report.ok(f"variant: the initial checkpoint is a {variant} checkpoint (model.variant)")
    return True


def compose_recipe(config_dir: Path, overrides: list[str]):
    """Composes the recipe with Hydra's compose API (no working-directory change, no outputs)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base=None):
        return compose(config_name=CONFIG_NAME, overrides=overrides)


def check_config(s: Settings, env: Mapping[str, str], config_dir: Path, report: Report) -> Plan | None:
    """Locked constants, topology and the typed schema of the composed recipe."""
    from omegaconf import OmegaConf

    from verl_omni.trainer.config import ConfigError, trainer_config_from_dict
    from verl_omni.trainer.topology import TopologyError, resolve_config_topology

    locked_path = config_dir / LOCKED_FILE
    if not (config_dir / f"{CONFIG_NAME}.yaml").is_file() or not locked_path.is_file():
        report.fail(
            str(config_dir),
            f"{config_dir}: recipe files {CONFIG_NAME}.yaml and {LOCKED_FILE} not found; "
            "restore recipes/wnm_3d/stage3/config from the repository",
        )
        return None
    problems = locked_file_problems(locked_path)
    try:
        raw = compose_recipe(config_dir, [])
        tree = OmegaConf.to_container(raw, resolve=True)
    except Exception as e:  # Hydra/OmegaConf raise many types; all mean the recipe does not compose here
        report.fail(str(config_dir), f"the recipe does not compose: {type(e).__name__}: {e}")
        return None
    problems += locked_constant_problems(tree, f"composed recipe {config_dir / (CONFIG_NAME + '.yaml')}")
    if str((tree.get("rollout") or {}).get("backend")) == "vllm_omni" and s.backend != "vllm_omni":
        from verl_omni.pipelines.wnm_vllm_omni.extra import missing_extra_message, vllm_omni_available

        if not vllm_omni_available():
            report.fail(str(config_dir / f"{CONFIG_NAME}.yaml"), missing_extra_message("rollout.backend: vllm_omni"))
    for p in problems:
        report.fail(
            str(locked_path),
            p + ": restore the file from the repository; changing an algorithm constant makes a different recipe",
        )
    if problems:
        return None
    report.ok(f"locked constants: recipe {recipe_name()} unchanged")
    train_size = s.ints.get("WAM_EXPECTED_TRAIN_SIZE")
    if train_size is None:
        return None
    topo = tree["topology"]
    gpus = int(topo["gpus_per_node"])
    try:
        # The same function the driver calls on the same composed recipe (data.expected_train_size comes from
        # WAM_EXPECTED_TRAIN_SIZE there too), so both see the same batch sizes.
        resolved, plan = resolve_config_topology(tree)
    except TopologyError as e:
        subject = "WAM_GPUS_PER_NODE" if gpus > 0 else "WAM_CPU_WORKERS"
        report.fail(
            subject,
            f"{e} (NNODES={topo['nnodes']}, {subject}={gpus or topo['cpu_workers_per_node']}, "
            f"WAM_EXPECTED_TRAIN_SIZE={train_size})",
        )
        return None
    rollout_chunk = int(tree["rollout"]["micro_batch_size"])
    if gpus > 0 and plan.micro_batch_rollouts != rollout_chunk:
        # bf16 GEMMs round differently for different batch sizes: only equal shapes give ratio == 1 exactly.
        report.note(
            f"rollout.micro_batch_size={rollout_chunk} differs from the resolved topology.micro_batch_rollouts="
            f"{plan.micro_batch_rollouts}: on GPUs the update recomputes window log-probs at another batch shape "
            "than the rollout, so bf16 ratios start near 1 (about 3e-4 in log-prob at Wan-1.3B) rather than "
            "exactly 1; equal values (with actor.gradient_checkpointing) make them exact (docs/benchmarks.md)"
        )
    try:
        cfg = trainer_config_from_dict(copy.deepcopy(resolved))
    except (ConfigError, TypeError, ValueError) as e:
        report.fail(str(config_dir / f"{CONFIG_NAME}.yaml"), f"the composed recipe is invalid: {e}")
        return None
    if not variant_matches(s, cfg.model.variant, locked_path, report):
        return None
    try:
        from verl_omni.utils.reward_score import build_reward_set

        build_reward_set(resolved["reward"]["reward_set"])
    except ValueError as e:
        report.fail(str(locked_path), f"reward.reward_set is rejected by build_reward_set: {e}")
        return None
    report.ok("config: recipe composes and validates; topology resolved")
    return Plan(resolved=resolved, topology_text=plan.describe())


def run_checks(env: Mapping[str, str], config_dir: Path, paths_env: str = "") -> tuple[Report, Plan | None]:
    """Runs every check; configuration checks read ``os.environ`` through Hydra's ``oc.env`` resolver."""
    report = Report()
    s = check_environment(env, report, paths_env)
    if report.failures:
        # The deeper checks read the files these variables name; fix the environment first.
        report.note("checkpoint and data checks skipped until the environment problems above are fixed")
    else:
        contract = check_checkpoints(s, report)
        if contract is not None:
            check_data(s, contract, report)
        else:
            report.note("data checks skipped: they need both checkpoints readable and compatible")
    plan = None
    if not report.failures:
        plan = check_config(s, env, config_dir, report)
        if plan is not None:
            check_run_provenance(s, plan, report, env)
    else:
        # Locked constants are checked even when other items failed: a changed constant must always be named.
        locked_path = config_dir / LOCKED_FILE
        if locked_path.is_file():
            for p in locked_file_problems(locked_path):
                report.fail(str(locked_path), p + ": restore the file from the repository")
        report.note("topology and schema checks skipped until the items above pass")
    return report, plan


def write_plan(directory: Path, plan: Plan, report: Report) -> None:
    """Writes resolved_config.yaml, topology.txt and contract_check.txt into a new directory (atomic).

    They are records of what was checked: the driver composes and resolves the same recipe itself.
    """
    import yaml

    if directory.exists():
        raise FileExistsError(f"{directory}: already exists; refusing to overwrite")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(directory.name + ".tmp")
    tmp.mkdir()
    (tmp / "resolved_config.yaml").write_text(yaml.safe_dump(plan.resolved, sort_keys=False))
    (tmp / "topology.txt").write_text(plan.topology_text + "\n")
    (tmp / "contract_check.txt").write_text("".join(f"ok: {m}\n" for m in report.passed))
    os.replace(tmp, directory)


GENERATED_HEADER = (
    "# GENERATED by scripts/generate_trainer_config.sh from recipes/wnm_3d/stage3/config/*.yaml: do not edit.\n"
    "# The composed trainer config of recipe {recipe}, with environment interpolations unresolved.\n"
    "# Documentation of every field: the comments in config/stage3.yaml and config/locked.yaml.\n"
)


def flattened_recipe(config_dir: Path) -> str:
    """The composed recipe as one YAML document (``${oc.env:...}`` left unresolved), with a header."""
    from omegaconf import OmegaConf

    cfg = compose_recipe(config_dir, [])
    return GENERATED_HEADER.format(recipe=recipe_name()) + OmegaConf.to_yaml(cfg, resolve=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-dir", required=True, type=Path, help="recipes/wnm_3d/stage3/config")
    parser.add_argument("--paths-env", default="", help="paths.env file that was loaded (named in messages)")
    parser.add_argument(
        "--write-plan",
        type=Path,
        default=None,
        help="after a successful check, write the resolved config snapshot and topology here (new dir)",
    )
    parser.add_argument(
        "--flatten-to",
        type=Path,
        default=None,
        help="only write the composed, unresolved recipe to this file (generate_trainer_config.sh)",
    )
    args = parser.parse_args(argv)
    if args.flatten_to is not None:
        tmp = args.flatten_to.with_name(args.flatten_to.name + ".tmp")
        tmp.write_text(flattened_recipe(args.config_dir))
        os.replace(tmp, args.flatten_to)
        print(f"wrote {args.flatten_to}")
        return 0
    env = dict(os.environ)
    if not env.get("WAM_GPUS_PER_NODE", "").strip():
        # The recipe reads the GPU count from the environment; detect it once, like launch.sh does.
        os.environ["WAM_GPUS_PER_NODE"] = env["WAM_GPUS_PER_NODE"] = str(launch_env.detect_gpus())
    print(f"== Stage-III contract check: recipe {recipe_name()}")
    if args.paths_env:
        print(f"   paths.env: {args.paths_env}")
    overridden = [v for v in env.get("WAM_ENV_OVERRIDES", "").split() if v]
    if overridden:
        print(f"   taken from the environment instead of paths.env: {', '.join(overridden)}")
    report, plan = run_checks(env, args.config_dir, args.paths_env)
    for message in report.passed:
        print(f"[ok]   {message}")
    for subject, message in report.failures:
        print(f"[FAIL] {subject}: {message}" if not message.startswith(subject) else f"[FAIL] {message}")
    for message in report.notes:
        print(f"[skip] {message}")
    if not report.success or plan is None:
        print(f"contract check FAILED: {len(report.failures)} problem(s); nothing was started", file=sys.stderr)
        return 1
    print(plan.topology_text)
    if args.write_plan is not None:
        write_plan(args.write_plan, plan, report)
    print(OK_TOKEN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
