"""What the Stage-III study runs: the arms (main recipe and its three ablations), seeds and trainer configs.

Pure functions: they turn a :class:`StudySettings` and workspace paths into trainer config dicts (the same
tree ``python -m verl_omni.trainer.main_stage3`` composes from a YAML file). The recipe's locked constants
(``recipes/wnm_3d/stage3/config/locked.yaml``) are the starting point, so the study trains the recipe and
only overrides what the study has to (run length, learning rate, topology, intervals) plus, for an
ablation, the one switch it ablates.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOCKED_RECIPE = REPO / "recipes" / "wnm_3d" / "stage3" / "config" / "locked.yaml"


@dataclass(frozen=True)
class Arm:
    """One configuration of the study.

    Attributes:
        name: Short identifier (folder name).
        label: Human-readable description for tables and plots.
        overrides: Dotted trainer-config keys that differ from the main recipe.
    """

    name: str
    label: str
    overrides: dict = field(default_factory=dict)


ARMS: tuple[Arm, ...] = (
    Arm("main", "recipe: layer-conditioned, stratum baseline, shared x_0"),
    Arm("abl_a_summed", "(a) one advantage from the summed reward", {"algorithm.layer_conditioned": False}),
    Arm("abl_b_prompt_baseline", "(b) prompt-mean baseline", {"algorithm.baseline": "prompt"}),
    Arm("abl_c_independent_noise", "(c) independent x_0 per rollout", {"rollout.shared_initial_noise": False}),
)
# Opt-in arms, not ablations of the issue: run only when named in --arms (with the ablation seeds). They keep a
# recipe change measurable after it entered the recipe.
EXTRA_ARMS: tuple[Arm, ...] = (
    # The recipe before verl_omni.utils.reward_score.navigation's charge_stop_chunk (session 17 compared the two).
    Arm(
        "no_stop_chunk_charge",
        "recipe without charge_stop_chunk (a short STOP's chunk scored on its driven steps only)",
        {"reward.reward_set.rewards.navigation.charge_stop_chunk": False},
    ),
    # A candidate, not the recipe: every premature STOP charged the missed-STOP penalty before its distance term
    # (verl_omni.utils.reward_score.stop, premature_base), so that near the goal a STOP no longer out-scores
    # standing still in the summed reward. Enters the recipe only with a closed-loop comparison.
    Arm(
        "cand_premature_base",
        "recipe + premature STOP charged 1.0 + 0.5 m^-1 x distance (cap 3.0)",
        {
            "reward.reward_set.rewards.stop.premature_base": 1.0,
            "reward.reward_set.rewards.stop.premature_cap": 3.0,
        },
    ),
)
ARM_BY_NAME = {a.name: a for a in (*ARMS, *EXTRA_ARMS)}


@dataclass(frozen=True)
class StudySettings:
    """Run length and the study's deviations from the recipe.

    Attributes:
        steps: Training steps per run.
        lr: AdamW learning rate (the recipe's 1e-5 is sized for billion-parameter DiTs; see docs/results.md).
        lr_warmup_steps: Linear warm-up steps.
        prompts_per_step: Prompts per step (16 rollouts each); also the PPO mini-batch, so each step makes one
            on-policy update.
        micro_batch_rollouts: Rollouts per forward/backward on the one rank.
        rollout_micro_batch: Rollouts per DiT forward during generation.
        val_freq / val_max_samples: Event-balanced validation interval (steps) and rows.
        save_freq: Checkpoint interval (the deadline guard falls back to the last checkpoint).
        gpus: GPUs per run (0 = CPU workers).
        cpu_workers: Actor processes per run on CPU.
        main_seeds / ablation_seeds: Seeds of the main arm and of each ablation (ablations reuse main seeds so
            that comparisons are paired on the same seed).
    """

    steps: int = 120
    lr: float = 1e-4
    lr_warmup_steps: int = 5
    prompts_per_step: int = 4
    micro_batch_rollouts: int = 32
    rollout_micro_batch: int = 64
    val_freq: int = 10
    val_max_samples: int = 12
    save_freq: int = 10
    gpus: int = 1
    cpu_workers: int = 1
    main_seeds: tuple[int, ...] = (1, 2, 3)
    ablation_seeds: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "micro_batch_rollouts", "rollout_micro_batch", "save_freq"):
            if getattr(self, name) < 1:
                raise ValueError(f"StudySettings.{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("val_freq", "val_max_samples", "lr_warmup_steps", "gpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"StudySettings.{name}: must be >= 0, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"StudySettings.lr: must be a positive number, got {self.lr}")
        if self.gpus == 0 and self.cpu_workers < 1:
            raise ValueError("StudySettings.cpu_workers: must be >= 1 when gpus is 0")
        if not self.main_seeds:
            raise ValueError("StudySettings.main_seeds: needs at least one seed")
        if len(set(self.main_seeds)) != len(self.main_seeds):
            raise ValueError(f"StudySettings.main_seeds: repeated seeds {self.main_seeds}")
        world = self.gpus or self.cpu_workers
        if (16 * self.prompts_per_step) % (world * self.micro_batch_rollouts):
            raise ValueError(
                f"StudySettings.micro_batch_rollouts: {16 * self.prompts_per_step} rollouts per step over {world} "
                f"rank(s) are not a multiple of {self.micro_batch_rollouts}"
            )


@dataclass(frozen=True)
class RunSpec:
    """One training run: an arm at a seed."""

    arm: Arm
    seed: int

    @property
    def name(self) -> str:
        return f"{self.arm.name}_s{self.seed}"


def plan_runs(settings: StudySettings, arms: tuple[str, ...] | None = None) -> list[RunSpec]:
    """The runs of the study, main seeds first (so that they start first when slots are scarce).

    ``arms`` None means the recipe and its ablations (:data:`ARMS`); an :data:`EXTRA_ARMS` arm runs only when named.

    Raises:
        ValueError: an unknown arm name (lists the known ones).
    """
    names = arms or tuple(a.name for a in ARMS)
    unknown = [n for n in names if n not in ARM_BY_NAME]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; known: {list(ARM_BY_NAME)}")
    runs = []
    for n in names:
        seeds = settings.main_seeds if n == "main" else settings.ablation_seeds
        runs += [RunSpec(ARM_BY_NAME[n], s) for s in seeds]
    return sorted(runs, key=lambda r: (r.arm.name != "main", r.seed, r.arm.name))


def load_locked_recipe(path: Path = LOCKED_RECIPE) -> dict:
    """The recipe's locked algorithm constants (rollout, algorithm, actor, reward sections)."""
    import yaml

    data = yaml.safe_load(path.read_text())
    return {k: data[k] for k in ("rollout", "algorithm", "actor", "reward") if k in data}


def set_dotted(tree: dict, dotted: str, value) -> None:
    """Sets ``tree[a][b][c] = value`` for ``dotted = "a.b.c"`` (creating missing levels)."""
    node = tree
    keys = dotted.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value


def trainer_config(run: RunSpec, settings: StudySettings, ws: dict, output_dir: Path, locked: dict) -> dict:
    """The full trainer config tree of one run.

    Args:
        run: Arm and seed.
        settings: Study settings.
        ws: Workspace paths: ``ckpt``, ``train``, ``eventval``, ``scenes``, ``train_size`` (and optionally
            ``val_rows``).
        output_dir: The run's ``trainer.output_dir``.
        locked: :func:`load_locked_recipe` output.
    """
    cfg = copy.deepcopy(locked)
    cfg["model"] = {"initial_checkpoint": str(ws["ckpt"]), "data_contract_checkpoint": str(ws["ckpt"])}
    cfg["data"] = {
        "train_root": str(ws["train"]),
        "val_file": str(ws["eventval"]),
        "expected_train_size": int(ws["train_size"]),
        # Never more than the validation set holds (the trainer refuses that).
        "val_max_samples": min(settings.val_max_samples, int(ws.get("val_rows", settings.val_max_samples))),
        # The prompt order is part of what a seed varies.
        "seed": run.seed,
    }
    cfg["reward"]["num_workers"] = 1
    cfg["reward"]["reward_set"]["occupancy_root"] = str(ws["scenes"])
    cfg["rollout"]["micro_batch_size"] = settings.rollout_micro_batch
    cfg["actor"]["lr"] = settings.lr
    cfg["actor"]["lr_warmup_steps"] = settings.lr_warmup_steps
    cfg["topology"] = {
        "nnodes": 1,
        "gpus_per_node": settings.gpus,
        "cpu_workers_per_node": settings.cpu_workers,
        "prompts_per_step": settings.prompts_per_step,
        # One mini-batch per step: every update is on-policy (ratio exactly 1), see docs/results.md.
        "ppo_mini_batch_prompts": settings.prompts_per_step,
        "micro_batch_rollouts": settings.micro_batch_rollouts,
    }
    cfg["trainer"] = {
        "total_steps": settings.steps,
        "save_freq": settings.save_freq,
        "val_freq": settings.val_freq,
        "log_media_freq": 0,
        "output_dir": str(output_dir),
        "seed": run.seed,
        "resume": "never",
        "experiment_name": run.name,
        # Bitwise-deterministic kernels cost speed on the GPU; every run still uses the request-level RNG.
        "deterministic": settings.gpus == 0,
        "max_checkpoints_to_keep": 2,
    }
    for dotted, value in run.arm.overrides.items():
        set_dotted(cfg, dotted, value)
    return cfg
