"""Closed-loop evaluation of a navigation policy in synthetic scenes (docs/design.md, "Stage II").

Receding horizon: every active episode renders its history (the last ``history_frames`` frames, one per
visited pose; before that many exist the first frame repeats, like the converter's clamped history
indices), the policy returns 32 action steps for each of them in one batched call, and only the first
``execute_steps`` (8, one chunk) are executed before the policy is asked again. An episode ends at the first
executed STOP flag (a STOP later in the sample than the executed chunk is not acted on: the policy is asked
again from the new state) or after ``max_steps`` motion steps.

Collisions: the robot is a disc of ``robot_radius`` metres; each step's translation is swept along its straight
segment (:meth:`OccupancyMap.segment_collides`). With ``collision="block"`` (the default) a step that would
sweep into occupied space is one collision and its translation is refused: the robot stays where it is but
still applies the step's rotation (a disc turning in place cannot collide), and the episode goes on. This
matches the data-collection policy and keeps a bump from being conflated with a failed episode; repeated
pushing against a wall counts every time. With ``collision="end"`` the first collision ends the episode.

Distances (success, oracle success, NE, the SPL shortest path) are geodesic distances to the goal on the
scene's occupancy grid (:meth:`OccupancyMap.geodesic_at`, 8-connected, un-inflated), so SPL's ``l`` and NE use
the same field; ``p`` is the Euclidean length of the translations actually executed.

Policies implement :class:`Policy`. :class:`PolicyQuery` also hands over the pose and the goal: privileged
information meant for scripted reference policies only; the WNM policy (``verl_omni.sim.wnm_policy``) uses the
frames and the instruction alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from verl_omni.data.actions import integrate_actions
from verl_omni.data.convert import history_indices
from verl_omni.data.occupancy import ROBOT_RADIUS_M, OccupancyMap
from verl_omni.sim.eval_metrics import blocked_runs, spl
from verl_omni.sim.floorplan import FloorPlan
from verl_omni.sim.render import CameraConfig, Renderer

COLLISION_MODES = ("block", "end")
END_REASONS = ("stop", "max_steps", "collision")


# ---------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class ClosedLoopConfig:
    """How episodes are executed.

    Attributes:
        max_steps: Motion steps an episode may take before it is ended without STOP.
        execute_steps: Action steps executed per policy call (one chunk of 8 by default).
        robot_radius: Disc footprint radius (metres) used for collisions.
        collision: ``block`` (translation refused, episode continues) or ``end`` (episode ends).
        collision_samples_per_metre: Sweep sampling density; ``None`` = two samples per grid cell.
        stop_threshold: A step whose stop channel exceeds this is a STOP (decoded flags are 0/1).
        fov_deg: Horizontal field of view of the rendered history (the synthesizer's default is 90).
    """

    max_steps: int = 128
    execute_steps: int = 8
    robot_radius: float = ROBOT_RADIUS_M
    collision: str = "block"
    collision_samples_per_metre: float | None = None
    stop_threshold: float = 0.5
    fov_deg: float = 90.0

    def __post_init__(self) -> None:
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise ValueError(f"ClosedLoopConfig.max_steps: must be an int >= 1, got {self.max_steps!r}")
        if isinstance(self.execute_steps, bool) or not isinstance(self.execute_steps, int) or self.execute_steps < 1:
            raise ValueError(f"ClosedLoopConfig.execute_steps: must be an int >= 1, got {self.execute_steps!r}")
        if not self.robot_radius > 0:
            raise ValueError(f"ClosedLoopConfig.robot_radius: must be > 0, got {self.robot_radius}")
        if self.collision not in COLLISION_MODES:
            raise ValueError(f"ClosedLoopConfig.collision: must be one of {COLLISION_MODES}, got {self.collision!r}")
        if self.collision_samples_per_metre is not None and not self.collision_samples_per_metre > 0:
            raise ValueError(
                f"ClosedLoopConfig.collision_samples_per_metre: must be > 0, got {self.collision_samples_per_metre}"
            )
        if not 10.0 <= self.fov_deg <= 170.0:
            raise ValueError(f"ClosedLoopConfig.fov_deg: must be in [10, 170], got {self.fov_deg}")


# ---------------------------------------------------------------------------------------------- episodes
@dataclass(frozen=True)
class EpisodeSpec:
    """One evaluation episode (identical for every policy evaluated on it).

    Attributes:
        episode_id: Unique name; with ``seed`` it keys the policy's sampling noise.
        scene_id: Scene it runs in.
        start_pose: ``(x, y, yaw)`` start pose.
        goal: ``(x, y)`` goal point.
        instruction: Language instruction.
        success_radius: Success radius (metres, geodesic).
        shortest_path_m: Geodesic start-goal distance (SPL's ``l``).
        seed: Noise seed of the policy's samples in this episode.
        goal_object: Name of the goal object (informational).
    """

    episode_id: str
    scene_id: str
    start_pose: tuple[float, float, float]
    goal: tuple[float, float]
    instruction: str
    success_radius: float
    shortest_path_m: float
    seed: int
    goal_object: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "start_pose", tuple(float(v) for v in self.start_pose))
        object.__setattr__(self, "goal", tuple(float(v) for v in self.goal))
        if not self.episode_id or not self.scene_id:
            raise ValueError(f"EpisodeSpec: episode_id and scene_id must be non-empty, got {self.episode_id!r}")
        if len(self.start_pose) != 3 or len(self.goal) != 2:
            raise ValueError(f"EpisodeSpec {self.episode_id}: start_pose needs 3 values and goal 2")
        if not all(math.isfinite(v) for v in self.start_pose + self.goal):
            raise ValueError(f"EpisodeSpec {self.episode_id}: start_pose and goal must be finite")
        if not self.success_radius > 0:
            raise ValueError(f"EpisodeSpec {self.episode_id}: success_radius must be > 0, got {self.success_radius}")
        if not (math.isfinite(self.shortest_path_m) and self.shortest_path_m > 0):
            raise ValueError(
                f"EpisodeSpec {self.episode_id}: shortest_path_m must be finite and > 0, got {self.shortest_path_m}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"EpisodeSpec {self.episode_id}: seed must be a non-negative int, got {self.seed!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["start_pose"], d["goal"] = list(self.start_pose), list(self.goal)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> EpisodeSpec:
        return cls(**dict(d))


# ---------------------------------------------------------------------------------------------- policy
@dataclass(frozen=True)
class PolicyQuery:
    """What a policy is told about one episode besides its history frames.

    Attributes:
        episode_id: Episode name (noise key).
        seed: Episode noise seed.
        call_index: 0-based index of this policy call within the episode (noise key).
        instruction: Language instruction.
        pose: ``[3]`` current pose. Privileged: for scripted reference policies only.
        goal: ``[2]`` goal point. Privileged: for scripted reference policies only.
        scene_id: Scene of the episode. Privileged (it names the map): for scripted reference policies only.
    """

    episode_id: str
    seed: int
    call_index: int
    instruction: str
    pose: np.ndarray
    goal: np.ndarray
    scene_id: str = ""


@runtime_checkable
class Policy(Protocol):
    """A navigation policy evaluated in closed loop.

    A policy may also define ``call_notes() -> list[dict | None]``: one JSON-ready note (or None) per query of its
    last ``act`` call, kept in :attr:`EpisodeResult.policy_notes` (the loop adds the call index and motion step).

    Attributes:
        image_size: ``(H, W)`` of the frames it expects.
        history_frames: Frames of history per call (33 for WNM).
    """

    image_size: tuple[int, int]
    history_frames: int

    def act(self, history: np.ndarray, queries: Sequence[PolicyQuery]) -> np.ndarray:
        """Actions for a batch of episodes.

        Args:
            history: ``uint8 [B, history_frames, H, W, 3]``; the last frame is the current view.
            queries: ``B`` queries, in the order of ``history``.

        Returns:
            ``[B, S, 4]`` decoded actions ``(dx, dy, dyaw, stop)`` (metres, radians, 0/1), ``S >= execute_steps``
            (32 for WNM), each step in the robot frame of the previous pose.
        """
        ...


# ---------------------------------------------------------------------------------------------- stepping
@dataclass
class StepOutcome:
    """Result of executing a chunk of actions from one pose.

    Attributes:
        poses: ``[M, 3]`` poses after each executed motion step (the start pose excluded).
        actions: ``[M, 4]`` the motion steps executed (the STOP step is not included).
        blocked: ``bool [M]`` the step's translation was refused because of a collision.
        stopped: A STOP flag ended the chunk (after the ``M`` motion steps).
        path_length: Metres actually travelled.
        ended_by_collision: ``collision="end"`` and a collision happened (the last step).
    """

    poses: np.ndarray
    actions: np.ndarray
    blocked: np.ndarray
    stopped: bool
    path_length: float
    ended_by_collision: bool

    @property
    def collisions(self) -> int:
        return int(self.blocked.sum())


def execute_actions(
    occupancy: OccupancyMap,
    pose: np.ndarray,
    actions: np.ndarray,
    robot_radius: float,
    collision: str = "block",
    samples_per_metre: float | None = None,
    stop_threshold: float = 0.5,
) -> StepOutcome:
    """Executes action steps one at a time from ``pose``, with disc-footprint collision checks.

    Args:
        occupancy: The scene.
        pose: ``[3]`` start pose.
        actions: ``[K, 4]`` decoded actions; steps are taken until the first STOP flag.
        robot_radius: Disc radius (metres).
        collision: ``block`` or ``end`` (see the module docstring).
        samples_per_metre: Sweep sampling density (``None`` = two per cell).
        stop_threshold: STOP when the stop channel exceeds this.

    Returns:
        The :class:`StepOutcome`.

    Raises:
        ValueError: non-finite actions or a malformed shape.
    """
    if collision not in COLLISION_MODES:
        raise ValueError(f"execute_actions: collision must be one of {COLLISION_MODES}, got {collision!r}")
    actions = np.asarray(actions, np.float64)
    if actions.ndim != 2 or actions.shape[1] != 4:
        raise ValueError(f"execute_actions: actions must be [K, 4], got {actions.shape}")
    if not np.isfinite(actions).all():
        raise ValueError("execute_actions: actions contain NaN or inf")
    spm = samples_per_metre if samples_per_metre is not None else 2.0 / occupancy.resolution
    cur = np.asarray(pose, np.float64).reshape(3).copy()
    poses, done, blocked = [], [], []
    stopped = ended = False
    travelled = 0.0
    for step in actions:
        if step[3] > stop_threshold:
            stopped = True
            break
        # One step through the shared integrator, with the stop channel cleared (it was checked above).
        proposed = integrate_actions(cur, np.array([[step[0], step[1], step[2], 0.0]]))[-1]
        hit, _ = occupancy.segment_collides(cur[None, :2], proposed[None, :2], robot_radius, spm)
        if bool(hit[0]):
            proposed[:2] = cur[:2]  # translation refused, rotation kept
        else:
            travelled += float(np.hypot(*(proposed[:2] - cur[:2])))
        cur = proposed
        poses.append(cur.copy())
        done.append(step)
        blocked.append(bool(hit[0]))
        if hit[0] and collision == "end":
            ended = True
            break
    return StepOutcome(
        poses=np.asarray(poses, np.float64).reshape(-1, 3),
        actions=np.asarray(done, np.float64).reshape(-1, 4),
        blocked=np.asarray(blocked, bool),
        stopped=stopped,
        path_length=travelled,
        ended_by_collision=ended,
    )


# ---------------------------------------------------------------------------------------------- results
@dataclass
class EpisodeResult:
    """Outcome of one episode under one policy.

    Attributes:
        episode_id / scene_id: From the spec.
        success / oracle_success / spl / ne / collisions / collided: Metrics (``verl_omni.sim.eval_metrics``;
            ``metrics()`` adds the contact counts derived from ``blocked``).
        path_length: Metres travelled.
        steps: Motion steps executed.
        policy_calls: Policy calls made.
        end_reason: ``stop``, ``max_steps`` or ``collision``.
        poses: ``[steps + 1, 3]`` visited poses (start first).
        actions: ``[steps, 4]`` executed motion steps.
        blocked: ``bool [steps]`` steps whose translation was refused.
        geodesic: ``[steps + 1]`` geodesic distance to the goal at each pose.
        policy_notes: What the policy said about its own calls, for the calls it said something about
            (``Policy.call_notes``; e.g. the STOP gate's view where a STOP was asked for). Each note is a JSON-ready
            dict with the ``call`` index and the motion ``step`` it was made at (an index into ``poses`` and
            ``geodesic``).
    """

    episode_id: str
    scene_id: str
    success: bool
    oracle_success: bool
    spl: float
    ne: float
    collisions: int
    collided: bool
    path_length: float
    steps: int
    policy_calls: int
    end_reason: str
    poses: np.ndarray = field(repr=False)
    actions: np.ndarray = field(repr=False)
    blocked: np.ndarray = field(repr=False)
    geodesic: np.ndarray = field(repr=False)
    policy_notes: list[dict] = field(default_factory=list, repr=False)

    def metrics(self) -> dict:
        """Scalar fields (JSON-ready)."""
        return {
            "episode_id": self.episode_id,
            "scene_id": self.scene_id,
            "success": bool(self.success),
            "oracle_success": bool(self.oracle_success),
            "spl": float(self.spl),
            "ne": float(self.ne),
            "collisions": int(self.collisions),
            "collided": bool(self.collided),
            **dict(zip(("collision_events", "longest_blocked_run"), blocked_runs(self.blocked), strict=True)),
            "path_length": float(self.path_length),
            "steps": int(self.steps),
            "policy_calls": int(self.policy_calls),
            "end_reason": self.end_reason,
            # Geodesic distance gained toward the goal (start minus end); negative when it moved away.
            "progress": float(self.geodesic[0] - self.geodesic[-1]),
            # STOP issued outside the success radius: the gaming sign beside SR.
            "premature_stop": bool(self.end_reason == "stop" and not self.success),
        }

    def to_dict(self) -> dict:
        """Metrics plus the trajectory (JSON-ready)."""
        return {
            **self.metrics(),
            "poses": self.poses.tolist(),
            "actions": self.actions.tolist(),
            "blocked": self.blocked.astype(int).tolist(),
            "geodesic": self.geodesic.tolist(),
            **({"policy_notes": list(self.policy_notes)} if self.policy_notes else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> EpisodeResult:
        """Inverse of ``to_dict`` (e.g. an episode of a ``closed_loop_eval.py`` report.json); the derived
        ``progress`` / ``premature_stop`` fields are recomputed by ``metrics()``, not read.

        Raises:
            KeyError: a field of ``to_dict`` is missing (a report written without trajectories).
        """
        poses = np.asarray(d["poses"], np.float64).reshape(-1, 3)
        return cls(
            episode_id=str(d["episode_id"]),
            scene_id=str(d["scene_id"]),
            success=bool(d["success"]),
            oracle_success=bool(d["oracle_success"]),
            spl=float(d["spl"]),
            ne=float(d["ne"]),
            collisions=int(d["collisions"]),
            collided=bool(d["collided"]),
            path_length=float(d["path_length"]),
            steps=int(d["steps"]),
            policy_calls=int(d["policy_calls"]),
            end_reason=str(d["end_reason"]),
            poses=poses,
            actions=np.asarray(d["actions"], np.float64).reshape(-1, 4),
            blocked=np.asarray(d["blocked"], bool).reshape(-1),
            geodesic=np.asarray(d["geodesic"], np.float64).reshape(-1),
            policy_notes=[dict(n) for n in d.get("policy_notes", [])],
        )


def episode_result(
    spec: EpisodeSpec,
    occupancy: OccupancyMap,
    poses: np.ndarray,
    actions: np.ndarray,
    blocked: np.ndarray,
    path_length: float,
    stopped: bool,
    end_reason: str,
    policy_calls: int,
    policy_notes: list[dict] | None = None,
) -> EpisodeResult:
    """Scores a finished trajectory (pure given the occupancy map).

    Raises:
        ValueError: a visited pose has no finite geodesic distance to the goal (it left the free space).
    """
    poses = np.asarray(poses, np.float64).reshape(-1, 3)
    geo = occupancy.geodesic_at(np.asarray(spec.goal), poses[:, :2])
    if not np.isfinite(geo).all():
        k = int(np.argmin(np.isfinite(geo)))
        raise ValueError(
            f"episode {spec.episode_id}: pose {k} {poses[k].tolist()} has no geodesic path to the goal in scene "
            f"{spec.scene_id!r} (outside the free space)"
        )
    ne = float(geo[-1])
    success = bool(stopped and ne <= spec.success_radius)
    blocked = np.asarray(blocked, bool)
    return EpisodeResult(
        episode_id=spec.episode_id,
        scene_id=spec.scene_id,
        success=success,
        oracle_success=bool((geo <= spec.success_radius).any()),
        spl=spl(success, spec.shortest_path_m, path_length),
        ne=ne,
        collisions=int(blocked.sum()),
        collided=bool(blocked.any()),
        path_length=float(path_length),
        steps=len(poses) - 1,
        policy_calls=int(policy_calls),
        end_reason=end_reason,
        poses=poses,
        actions=np.asarray(actions, np.float64).reshape(-1, 4),
        blocked=blocked,
        geodesic=geo,
        policy_notes=list(policy_notes or []),
    )


# ---------------------------------------------------------------------------------------------- the loop
@dataclass
class _EpisodeState:
    spec: EpisodeSpec
    renderer: Renderer
    occupancy: OccupancyMap
    poses: list[np.ndarray]
    frames: list[np.ndarray]
    actions: list[np.ndarray] = field(default_factory=list)
    blocked: list[bool] = field(default_factory=list)
    path_length: float = 0.0
    calls: int = 0
    end_reason: str | None = None
    stopped: bool = False
    notes: list[dict] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.poses) - 1

    def history(self, count: int) -> np.ndarray:
        """``uint8 [count, H, W, 3]``: the last ``count`` frames, the first frame repeated while too few exist."""
        return np.stack([self.frames[i] for i in history_indices(len(self.frames) - 1, count)])


def run_closed_loop(
    policy: Policy,
    plans: Mapping[str, FloorPlan],
    specs: Sequence[EpisodeSpec],
    config: ClosedLoopConfig | None = None,
    progress: bool = True,
    desc: str = "episodes",
) -> list[EpisodeResult]:
    """Runs every episode to its end; all active episodes share each policy call.

    Args:
        policy: The policy.
        plans: Scene id -> floor plan (with semantics, for rendering).
        specs: Episodes; each ``scene_id`` must be in ``plans``, ids unique.
        config: Execution settings.
        progress: Show a tqdm bar (one tick per finished episode).
        desc: Bar label.

    Returns:
        One :class:`EpisodeResult` per spec, in spec order.
    """
    from tqdm import tqdm

    cfg = config or ClosedLoopConfig()
    if not specs:
        raise ValueError("run_closed_loop: no episodes")
    ids = [s.episode_id for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError("run_closed_loop: episode ids must be unique")
    missing = sorted({s.scene_id for s in specs} - set(plans))
    if missing:
        raise KeyError(f"run_closed_loop: episodes refer to scenes that were not given: {missing}")
    h, w = (int(v) for v in policy.image_size)
    camera = CameraConfig(width=w, height=h, fov_deg=cfg.fov_deg)
    renderers = {sid: Renderer(plans[sid], camera) for sid in sorted({s.scene_id for s in specs})}
    states = []
    for s in specs:
        start = np.asarray(s.start_pose, np.float64)
        r = renderers[s.scene_id]
        states.append(_EpisodeState(s, r, plans[s.scene_id].occupancy(), [start], [r.render(start)]))
    count = int(policy.history_frames)
    with tqdm(total=len(states), desc=desc, unit="ep", disable=not progress) as bar:
        active = list(range(len(states)))
        while active:
            batch = [states[i] for i in active]
            history = np.stack([st.history(count) for st in batch])
            queries = [
                PolicyQuery(
                    episode_id=st.spec.episode_id,
                    seed=st.spec.seed,
                    call_index=st.calls,
                    instruction=st.spec.instruction,
                    pose=st.poses[-1].copy(),
                    goal=np.asarray(st.spec.goal),
                    scene_id=st.spec.scene_id,
                )
                for st in batch
            ]
            actions = np.asarray(policy.act(history, queries), np.float64)
            if actions.ndim != 3 or actions.shape[0] != len(batch) or actions.shape[2] != 4:
                raise ValueError(f"policy.act returned shape {actions.shape}, expected [{len(batch)}, S, 4]")
            if actions.shape[1] < cfg.execute_steps:
                raise ValueError(
                    f"policy.act returned {actions.shape[1]} steps, fewer than execute_steps={cfg.execute_steps}"
                )
            # Optional: a policy that explains its calls (e.g. the STOP gate's view) returns one note or None per query.
            call_notes = policy.call_notes() if hasattr(policy, "call_notes") else None
            if call_notes is not None and len(call_notes) != len(batch):
                raise ValueError(f"policy.call_notes returned {len(call_notes)} notes for {len(batch)} queries")
            for i, (st, acts) in enumerate(zip(batch, actions, strict=True)):
                if call_notes is not None and call_notes[i] is not None:
                    st.notes.append({"call": st.calls, "step": st.steps, **call_notes[i]})
                st.calls += 1
                budget = min(cfg.execute_steps, cfg.max_steps - st.steps)
                out = execute_actions(
                    st.occupancy,
                    st.poses[-1],
                    acts[:budget],
                    cfg.robot_radius,
                    cfg.collision,
                    cfg.collision_samples_per_metre,
                    cfg.stop_threshold,
                )
                if len(out.poses):
                    st.poses.extend(out.poses)
                    st.frames.extend(st.renderer.render(out.poses))
                    st.actions.extend(out.actions)
                    st.blocked.extend(out.blocked.tolist())
                st.path_length += out.path_length
                if out.stopped:
                    st.end_reason, st.stopped = "stop", True
                elif out.ended_by_collision:
                    st.end_reason = "collision"
                elif st.steps >= cfg.max_steps:
                    st.end_reason = "max_steps"
                if st.end_reason is not None:
                    bar.update()
            active = [i for i in active if states[i].end_reason is None]
    return [
        episode_result(
            st.spec,
            st.occupancy,
            np.asarray(st.poses),
            np.asarray(st.actions),
            np.asarray(st.blocked, bool),
            st.path_length,
            st.stopped,
            st.end_reason,
            st.calls,
            st.notes,
        )
        for st in states
    ]
