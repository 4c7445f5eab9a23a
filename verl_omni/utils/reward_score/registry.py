"""Reward registry and the reward set that combines registered modules into per-layer scores.

A reward module is a class registered with ``@register_reward("<name>")``. It declares a config dataclass
(always with a ``weight`` field), the layers it writes, and whether it needs the batch's scored
trajectories (``RolloutGeometry``). ``build_reward_set(config)`` validates the whole configuration at
construction; ``RewardSet.score(batch)`` returns, for every layer in ``LAYER_NAMES``,

    score[layer] = sum over modules m with weight_m > 0 of weight_m * module_m[layer]

plus diagnostics ``"<module>/<term>"`` (un-weighted, ``[N]`` or ``[N, 4]`` per chunk) and warnings. Two
safety rules keep a bad rollout from breaking a training step: an *invalid* rollout (see
``trajectory.py``) gets ``invalid_penalty`` on every ``nav_k`` and ``stop_k`` layer, and any non-finite
layer score left by a module is replaced by ``invalid_penalty``; both with a warning naming the rollout.

The output also carries which layers are *live* (``RewardOutput.layer_valid``, ``bool [N, 9]``, also as the
diagnostic ``geometry/layer_valid`` ``float32 [N, 9]`` so that it travels with the other diagnostics): the
chunks after a rollout's STOP or first hard collision decided nothing, so their scores are 0 and the trainer
leaves them out of the advantage statistics and the loss (``verl_omni.trainer.diffusion``).

Config layout (a plain dict or an OmegaConf mapping)::

    {"robot_radius": 0.2, "collision_samples_per_metre": 40, "max_step_m": 2.0, "stop_threshold": 0.5,
     "invalid_penalty": -5.0, "occupancy_root": "/path/or/None", "max_geodesic_fields": 512,
     "rewards": {"navigation": {"weight": 1.0, ...}, "stop": {...}, ...}}
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from verl_omni.pipelines.wnm_shared.layers import LAYER_NAMES
from verl_omni.utils.reward_score.scene_cache import SceneCache
from verl_omni.utils.reward_score.trajectory import GeometryConfig, RolloutGeometry, compute_geometry
from verl_omni.utils.reward_score.types import RewardBatch, RewardOutput

ACTION_LAYERS: tuple[str, ...] = tuple(name for name in LAYER_NAMES if name != "visual")


@dataclass
class ModuleResult:
    """What one reward module returns.

    Attributes:
        scores: ``{layer: float64 [N]}`` un-weighted scores for the layers the module writes.
        diagnostics: ``{term: [N] or [N, 4]}``.
        warnings: Messages naming rollouts or the batch.
    """

    scores: dict[str, np.ndarray]
    diagnostics: dict[str, np.ndarray] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RewardModuleConfig:
    """Base of every module config. Subclasses add their thresholds and term weights.

    Attributes:
        weight: Multiplier of the module's scores in the reward set (finite, >= 0; 0 disables the module).
    """

    weight: float = 1.0

    def __post_init__(self) -> None:
        check_non_negative(type(self).__name__, "weight", self.weight)


def check_non_negative(owner: str, name: str, value: Any) -> None:
    """Raises ``ValueError`` naming ``owner.name`` unless ``value`` is a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}.{name} must be a finite number >= 0, got {value!r}")


def check_positive(owner: str, name: str, value: Any) -> None:
    """Raises ``ValueError`` naming ``owner.name`` unless ``value`` is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a finite number > 0, got {value!r}")


class RewardModule(ABC):
    """One registered reward. Subclasses set the class attributes and implement ``score``."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type[RewardModuleConfig]] = RewardModuleConfig
    layers: ClassVar[tuple[str, ...]] = ()
    needs_geometry: ClassVar[bool] = True

    def __init__(self, config: RewardModuleConfig, geometry_config: GeometryConfig) -> None:
        self.config = config
        self.geometry_config = geometry_config

    @abstractmethod
    def score(self, batch: RewardBatch, geometry: RolloutGeometry | None) -> ModuleResult:
        """Scores a batch; must return finite values for valid rollouts and never raise on bad data."""


_REGISTRY: dict[str, type[RewardModule]] = {}


def register_reward(name: str):
    """Class decorator registering a ``RewardModule`` subclass under ``name``."""

    def wrap(cls: type[RewardModule]) -> type[RewardModule]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"reward {name!r} is already registered by {_REGISTRY[name].__qualname__}")
        if not issubclass(cls, RewardModule):
            raise TypeError(f"@register_reward({name!r}) needs a RewardModule subclass, got {cls!r}")
        unknown = set(cls.layers) - set(LAYER_NAMES)
        if unknown:
            raise ValueError(f"reward {name!r} declares unknown layer(s) {sorted(unknown)}; valid: {LAYER_NAMES}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def registered_rewards() -> tuple[str, ...]:
    """Names of all registered reward modules."""
    return tuple(sorted(_REGISTRY))


def _plain(value: Any) -> Any:
    """Converts nested mappings (dict, OmegaConf DictConfig) to plain dicts."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _build_config(owner: str, config_class: type, values: Mapping) -> Any:
    names = {f.name for f in dataclasses.fields(config_class) if f.init}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{owner}: unknown option(s) {unknown}; valid options: {sorted(names)}")
    return config_class(**values)


@dataclass(frozen=True)
class RewardSetConfig:
    """Top-level reward configuration (the module configs are validated by their own classes).

    Attributes:
        rewards: ``{name: module options}``; every name must be registered.
        invalid_penalty: Finite score given to every action layer of an invalid rollout (<= 0).
        occupancy_root: Scene directory root for the scene cache (None: maps are added in code).
        max_geodesic_fields: LRU bound of the scene cache.
    """

    rewards: dict = field(default_factory=dict)
    robot_radius: float = GeometryConfig.robot_radius
    collision_samples_per_metre: float = GeometryConfig.collision_samples_per_metre
    max_step_m: float = GeometryConfig.max_step_m
    stop_threshold: float = GeometryConfig.stop_threshold
    invalid_penalty: float = -5.0
    occupancy_root: str | None = None
    max_geodesic_fields: int = 512

    def __post_init__(self) -> None:
        if not isinstance(self.rewards, Mapping) or not self.rewards:
            raise ValueError("reward config: 'rewards' must be a non-empty mapping {name: options}")
        unknown = sorted(set(self.rewards) - set(_REGISTRY))
        if unknown:
            raise ValueError(
                f"reward config: unknown reward name(s) {unknown}; registered: {list(registered_rewards())}"
            )
        p = self.invalid_penalty
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or p > 0:
            raise ValueError(f"reward config: invalid_penalty must be a finite number <= 0, got {p!r}")
        if not isinstance(self.max_geodesic_fields, int) or self.max_geodesic_fields < 1:
            raise ValueError(
                f"reward config: max_geodesic_fields must be an integer >= 1, got {self.max_geodesic_fields!r}"
            )


class RewardSet:
    """A validated collection of reward modules sharing one scene cache.

    Args:
        config: Validated top-level config.
        modules: Constructed modules, in config order.
        scene_cache: Scene source; built from ``config.occupancy_root`` when omitted.
    """

    def __init__(self, config: RewardSetConfig, modules: list[RewardModule], scene_cache: SceneCache) -> None:
        self.config = config
        self.modules = modules
        self.scene_cache = scene_cache
        self.geometry_config = GeometryConfig(
            robot_radius=config.robot_radius,
            collision_samples_per_metre=config.collision_samples_per_metre,
            max_step_m=config.max_step_m,
            stop_threshold=config.stop_threshold,
        )

    @property
    def active_modules(self) -> list[RewardModule]:
        return [m for m in self.modules if m.config.weight > 0]

    def score(self, batch: RewardBatch) -> RewardOutput:
        """Scores ``N`` rollouts.

        Returns:
            ``RewardOutput`` with float32 ``[N]`` scores for every layer in ``LAYER_NAMES``.
        """
        n = batch.size
        scores = {name: np.zeros(n) for name in LAYER_NAMES}
        diagnostics: dict[str, np.ndarray] = {}
        warnings: list[str] = []
        geometry = None
        layer_valid = np.ones((n, len(LAYER_NAMES)), dtype=bool)
        if any(m.needs_geometry for m in self.active_modules):
            geometry = compute_geometry(batch, self.scene_cache, self.geometry_config)
            warnings += geometry.warnings
            diagnostics["geometry/valid"] = geometry.valid.astype(np.float32)
            diagnostics["geometry/stop_step"] = geometry.stop_step.astype(np.float32)
            diagnostics["geometry/collision_step"] = geometry.collision_step.astype(np.float32)
            diagnostics["geometry/end_step"] = geometry.end_step.astype(np.float32)
            layer_valid = geometry.layer_valid.copy()
            diagnostics["geometry/layer_valid"] = layer_valid.astype(np.float32)
        for module in self.active_modules:
            result = module.score(batch, geometry)
            for layer, values in result.scores.items():
                scores[layer] = scores[layer] + module.config.weight * np.asarray(values, dtype=np.float64)
            for term, values in result.diagnostics.items():
                diagnostics[f"{module.name}/{term}"] = np.asarray(values, dtype=np.float32)
            warnings += result.warnings
        penalty = float(self.config.invalid_penalty)
        if geometry is not None:
            for layer in ACTION_LAYERS:
                scores[layer] = np.where(geometry.valid, scores[layer], penalty)
        for layer in LAYER_NAMES:
            bad = ~np.isfinite(scores[layer])
            for i in np.flatnonzero(bad):
                warnings.append(
                    f"rollout {batch.rollout_id[i]}: non-finite {layer} score replaced by invalid_penalty {penalty}"
                )
            scores[layer] = np.where(bad, penalty, scores[layer]).astype(np.float32)
        for g, layer in enumerate(LAYER_NAMES):
            # Every term already vanishes after the end step; this keeps a dead layer at exactly 0 whatever a
            # module writes, so that summed scores never count what the mask leaves out of the loss.
            scores[layer] = np.where(layer_valid[:, g], scores[layer], 0.0).astype(np.float32)
        return RewardOutput(
            scores=scores,
            diagnostics=diagnostics,
            warnings=warnings,
            rollout_id=list(batch.rollout_id),
            layer_valid=layer_valid,
        )


def build_reward_set(config: Mapping, scene_cache: SceneCache | None = None) -> RewardSet:
    """Builds and validates a reward set from recipe config.

    Args:
        config: See the module docstring for the layout.
        scene_cache: Optional shared cache (e.g. with in-memory synthetic scenes).

    Raises:
        ValueError: naming the reward and option for an unknown name/option or an invalid value.
    """
    # Importing the built-in modules registers them.
    from verl_omni.utils.reward_score import builtin  # noqa: F401

    plain = _plain(config)
    if not isinstance(plain, dict):
        raise ValueError(f"reward config must be a mapping, got {type(config).__name__}")
    set_config = _build_config("reward config", RewardSetConfig, plain)
    geometry_config = GeometryConfig(
        robot_radius=set_config.robot_radius,
        collision_samples_per_metre=set_config.collision_samples_per_metre,
        max_step_m=set_config.max_step_m,
        stop_threshold=set_config.stop_threshold,
    )
    modules = []
    for name, options in set_config.rewards.items():
        cls = _REGISTRY[name]
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise ValueError(f"reward config: rewards.{name} must be a mapping of options, got {options!r}")
        try:
            module_config = _build_config(f"reward {name!r}", cls.config_class, options)
        except (TypeError, ValueError) as e:
            raise ValueError(f"reward {name!r}: {e}") from e
        modules.append(cls(module_config, geometry_config))
    if scene_cache is None:
        scene_cache = SceneCache(set_config.occupancy_root, max_geodesic_fields=set_config.max_geodesic_fields)
    return RewardSet(set_config, modules, scene_cache)
