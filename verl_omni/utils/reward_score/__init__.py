"""Stage-III rewards: navigation, collision, yaw guards, STOP, vision and flow, plus their registry.

Usage::

    reward_set = build_reward_set({"robot_radius": 0.2, "occupancy_root": root,
                                   "rewards": {"navigation": {}, "collision": {}, "yaw": {}, "stop": {},
                                               "vision": {}, "flow": {"weight": 0.0}}})
    out = reward_set.score(RewardBatch(...))   # out.scores[layer]: float32 [N] for every layer name

Each module's docstring defines its terms exactly (sign, units, caps); ``trajectory.py`` defines the
scored trajectory (first-STOP rule, hard-collision truncation) they all share.
"""

from verl_omni.utils.reward_score.registry import (
    ModuleResult,
    RewardModule,
    RewardModuleConfig,
    RewardSet,
    RewardSetConfig,
    build_reward_set,
    register_reward,
    registered_rewards,
)
from verl_omni.utils.reward_score.scene_cache import SceneCache
from verl_omni.utils.reward_score.trajectory import GeometryConfig, RolloutGeometry, compute_geometry
from verl_omni.utils.reward_score.types import EVENT_NAMES, RewardBatch, RewardOutput, RewardScores

__all__ = [
    "EVENT_NAMES",
    "GeometryConfig",
    "ModuleResult",
    "RewardBatch",
    "RewardModule",
    "RewardModuleConfig",
    "RewardOutput",
    "RewardScores",
    "RewardSet",
    "RewardSetConfig",
    "RolloutGeometry",
    "SceneCache",
    "build_reward_set",
    "compute_geometry",
    "register_reward",
    "registered_rewards",
]
