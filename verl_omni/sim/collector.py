"""DAgger-style collection of GN0 episodes in synthetic scenes.

A noisy policy (a stand-in for a Stage-II policy) drives from a start to a goal object, visiting states an
expert would not: its heading is perturbed, and now and then it drifts toward the nearest obstacle for a
few steps before recovering. At query states the expert continuation (33 poses: the current one and 32
future ones, with stop flags) is planned, rendered to ``ref_<t>.mp4`` and labelled with events.

Query states are every ``query_stride``-th frame plus states chosen so that each event type is sampled:
the end of every drift (close to an obstacle), the first frames within ``near_goal_distance_m`` and within
``premature_stop_distance_m`` of the goal, and the final frame (where the policy stopped).

Files written per episode follow ``docs/contracts.md`` (``episode.json``, ``rgb.mp4``, ``ref_<t>.mp4``).
All randomness of a scene comes from ``numpy.random.SeedSequence([seed, scene_index])``, so the result of a
scene does not depend on which worker process builds it or when.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from verl_omni.data.actions import wrap_angle
from verl_omni.data.video import write_video
from verl_omni.sim.events import EVENT_NAMES, EventThresholds, label_query
from verl_omni.sim.floorplan import FloorPlan, FloorPlanConfig, FloorPlanError, generate_floor_plan
from verl_omni.sim.goals import (  # SceneError and the samplers are also imported from here by older callers
    GOAL_POINTS,
    SceneError,
    check_plan_has_goals,
    goal_candidates,
    sample_task,
)
from verl_omni.sim.instructions import TEMPLATES, make_instructions
from verl_omni.sim.planner import ExpertPlanner, PlannerConfig, PlanningError, resample_polyline
from verl_omni.sim.render import CameraConfig, Renderer
from verl_omni.sim.search_expert import object_sightings, search_continuation, seen_in_history

COLLECTION_FORMAT = "gn0-dagger/1"


@dataclass(frozen=True)
class PolicyConfig:
    """The noisy data-collection policy.

    Attributes:
        heading_noise_rad: Std of the Gaussian noise added to the desired heading each step.
        drift_probability: Chance per step of starting a drift toward the nearest obstacle.
        drift_steps: Inclusive ``(min, max)`` length of a drift in steps.
        drift_stop_clearance_m: A drift ends once clearance falls below this.
        carrot_distance_m: Length of the expert path planned at each step (the policy steers along its first leg).
        precise_distance_m: Within this geodesic distance of the goal the policy drives without noise.
        max_steps: Episode length limit (frames - 1).
    """

    heading_noise_rad: float = 0.3
    drift_probability: float = 0.06
    drift_steps: tuple[int, int] = (3, 8)
    drift_stop_clearance_m: float = 0.24
    carrot_distance_m: float = 1.0
    precise_distance_m: float = 1.0
    max_steps: int = 160

    def __post_init__(self) -> None:
        if self.heading_noise_rad < 0:
            raise ValueError(f"PolicyConfig.heading_noise_rad: must be >= 0, got {self.heading_noise_rad}")
        if not 0 <= self.drift_probability <= 1:
            raise ValueError(f"PolicyConfig.drift_probability: must be in [0, 1], got {self.drift_probability}")
        if not 1 <= self.drift_steps[0] <= self.drift_steps[1]:
            raise ValueError(f"PolicyConfig.drift_steps: needs 1 <= min <= max, got {self.drift_steps}")
        if self.carrot_distance_m <= 0 or self.max_steps < 1 or self.precise_distance_m < 0:
            raise ValueError("PolicyConfig: carrot_distance_m > 0, precise_distance_m >= 0 and max_steps >= 1 required")


@dataclass(frozen=True)
class CollectorConfig:
    """Episode collection parameters.

    Attributes:
        fps: Frame rate written to the videos.
        target_frames: Frames of a reference video (the current one and ``target_frames - 1`` future ones).
        history_frames: History length the consumers use (recorded in ``collection.json``).
        success_radius: Success radius stored per episode (metres).
        min_goal_distance_m: Minimum geodesic start-goal distance.
        goal_object_distance_m: The goal lies within this distance of its object's surface.
        query_stride: Every this many frames is a query state.
        num_instructions: Instruction variants per episode.
        max_sampling_attempts: Attempts at drawing a valid goal/start before giving up.
        planner: Expert planner parameters.
        policy: Noisy policy parameters.
        events: Event thresholds.
        camera: Renderer camera.
        label_expert: Who labels the query states: ``map`` (the planner, from the first step) or ``search``
            (turn in place until the named object has been seen, then plan; :mod:`verl_omni.sim.search_expert`).
        face_goal_object: At the goal the expert turns in place toward the named object's centre before its
            STOP. Measured on ``one_room`` without it: the object is in view at only 42% of the states where the
            expert stops, so a policy cannot see why it stops there (and learned to stop out of sight of it).
        goal_point: Which point next to the named object is the goal (see :data:`GOAL_POINTS`): ``random`` (any
            free cell within ``goal_object_distance_m`` of it, the default of every earlier collection) or
            ``nearest`` (of those cells, the one geodesically nearest to the start). The instruction names only the
            object, so under ``random`` the side of the object that counts is hidden from every policy without the
            goal's coordinates: measured on the 400 held-out ``one_room`` episodes (seed 2000), a policy that drives
            perfectly to the object's near side would succeed in 18% of them, and guessing a side gives 24%.
            ``nearest`` makes the goal a function of what the policy sees and is told.
    """

    fps: int = 4
    target_frames: int = 33
    history_frames: int = 33
    success_radius: float = 0.5
    min_goal_distance_m: float = 3.0
    goal_object_distance_m: float = 0.7
    query_stride: int = 12
    num_instructions: int = 3
    max_sampling_attempts: int = 200
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    events: EventThresholds = field(default_factory=EventThresholds)
    camera: CameraConfig = field(default_factory=CameraConfig)
    label_expert: str = "map"
    face_goal_object: bool = False
    goal_point: str = "random"

    def __post_init__(self) -> None:
        if self.goal_point not in GOAL_POINTS:
            raise ValueError(f"CollectorConfig.goal_point: must be one of {GOAL_POINTS}, got {self.goal_point!r}")
        if self.label_expert not in ("map", "search"):
            raise ValueError(f"CollectorConfig.label_expert: must be 'map' or 'search', got {self.label_expert!r}")
        if self.fps < 1:
            raise ValueError(f"CollectorConfig.fps: must be >= 1, got {self.fps}")
        if self.target_frames < 2:
            raise ValueError(f"CollectorConfig.target_frames: must be >= 2, got {self.target_frames}")
        if self.history_frames < 1:
            raise ValueError(f"CollectorConfig.history_frames: must be >= 1, got {self.history_frames}")
        if self.success_radius <= self.planner.stop_distance:
            raise ValueError(
                f"CollectorConfig.success_radius ({self.success_radius}) must exceed planner.stop_distance "
                f"({self.planner.stop_distance}) so that the expert's STOP counts as a success"
            )
        if self.min_goal_distance_m < 0 or self.goal_object_distance_m <= 0:
            raise ValueError("CollectorConfig: min_goal_distance_m >= 0 and goal_object_distance_m > 0 required")
        if self.query_stride < 1:
            raise ValueError(f"CollectorConfig.query_stride: must be >= 1, got {self.query_stride}")
        if not 1 <= self.num_instructions <= len(TEMPLATES):
            raise ValueError(f"CollectorConfig.num_instructions: must be in [1, {len(TEMPLATES)}]")
        if self.max_sampling_attempts < 1:
            raise ValueError("CollectorConfig.max_sampling_attempts: must be >= 1")
        if self.events.robot_radius != self.planner.robot_radius:
            raise ValueError("CollectorConfig: events.robot_radius must equal planner.robot_radius")

    @property
    def horizon(self) -> int:
        return self.target_frames - 1


@dataclass
class Episode:
    """One collected episode before it is written.

    Attributes:
        record: The ``episode.json`` content.
        frames: ``uint8 [T, H, W, 3]`` policy frames.
        references: Query ``t`` -> ``uint8 [target_frames, H, W, 3]`` reference frames.
    """

    record: dict
    frames: np.ndarray
    references: dict[int, np.ndarray]


# ---------------------------------------------------------------------- goal and start sampling
# ---------------------------------------------------------------------- noisy policy
def _towards_obstacle(plan: FloorPlan, pose: np.ndarray) -> float:
    """Heading (radians) of the direction in which clearance drops fastest around ``pose``."""
    occ = plan.occupancy()
    ang = np.linspace(-math.pi, math.pi, 16, endpoint=False)
    probe = pose[:2] + 0.3 * np.stack([np.cos(ang), np.sin(ang)], 1)
    return float(ang[int(np.argmin(occ.clearance_at(probe)))])


def run_policy(
    plan: FloorPlan, planner: ExpertPlanner, start: np.ndarray, cfg: CollectorConfig, rng: np.random.Generator
) -> tuple[np.ndarray, list[int], bool]:
    """Rolls out the noisy policy.

    Returns:
        ``poses [T, 3]``; frame indices where a drift ended (close calls); and whether the policy stopped at
        the goal.
    """
    occ = plan.occupancy()
    pc, pl = cfg.policy, cfg.planner
    poses = [np.asarray(start, np.float64)]
    close_calls: list[int] = []
    drift_left = 0
    blocked = False  # the last move was refused: the next expert-following step goes without noise
    stopped = False
    for _ in range(pc.max_steps):
        pose = poses[-1]
        dist = float(planner.distance(pose[:2]))
        if dist <= pl.stop_distance:
            stopped = True
            break
        drifting = drift_left > 0
        if drifting:
            desired = _towards_obstacle(plan, pose) + rng.normal(0.0, 0.2)
            drift_left -= 1
        else:
            if dist > pc.precise_distance_m and rng.random() < pc.drift_probability:
                drift_left = int(rng.integers(pc.drift_steps[0], pc.drift_steps[1] + 1))
            # Steer to the point one step along the expert's smoothed path (collision-free by construction).
            path = planner.path(pose[:2], max_length_m=pc.carrot_distance_m)
            target = resample_polyline(path, pl.step_length)[min(1, len(path) - 1)]
            if np.hypot(*(target - pose[:2])) < 1e-9:
                target = planner.goal
            carrot = target - pose[:2]
            noisy = dist > pc.precise_distance_m and not blocked
            desired = math.atan2(carrot[1], carrot[0]) + (rng.normal(0.0, pc.heading_noise_rad) if noisy else 0.0)
        err = float(wrap_angle(desired - pose[2]))
        yaw = float(wrap_angle(pose[2] + np.clip(err, -pl.max_turn_rad, pl.max_turn_rad)))
        nxt = np.array([pose[0], pose[1], yaw])
        if abs(err) <= pl.max_turn_rad:
            # Near the goal never step past it.
            step = min(pl.step_length, dist) if dist <= pc.precise_distance_m else pl.step_length
            moved = pose[:2] + step * np.array([math.cos(yaw), math.sin(yaw)])
            hit, _ = occ.segment_collides(pose[None, :2], moved[None], pl.robot_radius, 2.0 / occ.resolution)
            too_close = drifting and float(occ.clearance_at(moved)) < pc.drift_stop_clearance_m
            refused = bool(hit[0]) or not bool(planner.reachable(moved)) or too_close
            if not refused:
                nxt[:2] = moved
            elif drifting:
                drift_left = 0  # the safety reflex ends the drift instead of moving closer
            elif blocked:
                # Refused twice in a row: take the expert's own step (or its first path vertex, a cell the
                # planner reaches the goal from) so that the policy always makes progress.
                fallback = target if bool(planner.reachable(target)) else path[min(1, len(path) - 1)]
                if not bool(occ.disc_collides(fallback, pl.robot_radius)):
                    nxt[:2] = fallback
                    refused = False
            blocked = refused
        poses.append(nxt)
        t = len(poses) - 1
        if drifting and drift_left == 0:
            close_calls.append(t)
    return np.asarray(poses), sorted(set(close_calls)), stopped


def query_times(poses: np.ndarray, planner: ExpertPlanner, close_calls: list[int], cfg: CollectorConfig) -> list[int]:
    """Query frame indices: the stride grid, close calls, first frames in the near-goal bands, the last frame."""
    n = len(poses)
    times = set(range(0, n, cfg.query_stride)) | set(close_calls) | {n - 1}
    geo = planner.distance(poses[:, :2])
    for band in (cfg.events.near_goal_distance_m, cfg.events.premature_stop_distance_m):
        inside = np.nonzero(geo <= band)[0]
        if inside.size:
            times.add(int(inside[0]))
    return sorted(t for t in times if 0 <= t < n)


# ---------------------------------------------------------------------- episodes and scenes
def _floats(a: np.ndarray) -> list:
    """Plain-Python floats for JSON (exact repr, so identical runs give identical files)."""
    return np.asarray(a, np.float64).tolist()


def collect_episode(
    plan: FloorPlan,
    renderer: Renderer,
    base_planner: ExpertPlanner,
    episode_id: str,
    cfg: CollectorConfig,
    rng: np.random.Generator,
) -> Episode:
    """Samples a task, runs the noisy policy, plans, renders and labels the query states.

    Returns:
        The episode (record, policy frames, reference frames per query).
    """
    obj_index, goal, planner, start = sample_task(plan, base_planner, cfg, rng)
    obj = plan.furniture[obj_index]
    room = plan.rooms[obj.room].kind
    instructions = make_instructions(room, obj.name, cfg.num_instructions, rng)
    poses, close_calls, stopped = run_policy(plan, planner, start, cfg, rng)
    return label_episode(plan, renderer, planner, episode_id, obj_index, instructions, poses, close_calls, stopped, cfg)


def label_episode(
    plan: FloorPlan,
    renderer: Renderer,
    planner: ExpertPlanner,
    episode_id: str,
    obj_index: int,
    instructions: list[str],
    poses: np.ndarray,
    close_calls: list[int],
    stopped: bool,
    cfg: CollectorConfig,
    policy_info: dict | None = None,
    frames: np.ndarray | None = None,
) -> Episode:
    """Relabels a driven trajectory with the expert: query states, expert continuations, events, frames.

    Whatever drove the robot (the noisy scripted policy, or a learned policy in DAgger collection), the labels
    are the expert's continuation from each query pose, so the data teaches how to recover from the states
    the behaviour policy reaches.

    Args:
        plan / renderer / planner: The scene, its renderer and the expert planner of this episode's goal.
        episode_id: Episode name.
        obj_index: Goal furniture index.
        instructions: Instruction variants.
        poses: ``[T, 3]`` visited poses (start first).
        close_calls: Frame indices close to an obstacle (extra query states).
        stopped: The behaviour policy ended the episode with STOP.
        cfg: Collection settings.
        policy_info: Optional per-episode facts about the behaviour policy (stored as ``behaviour``).
        frames: The trajectory's frames when already rendered (goal variants share them); rendered otherwise.

    Returns:
        The episode.
    """
    goal = planner.goal
    obj = plan.furniture[obj_index]
    room = plan.rooms[obj.room].kind
    occ = plan.occupancy()
    queries, references = [], {}
    times = query_times(poses, planner, close_calls, cfg)
    # A state the expert cannot plan from (in collision, or shut in away from the goal) is not queried. A robot
    # pressed against a wall is not such a state: the planner escapes from it (``ExpertPlanner.labelable``), so
    # the contacts a learner drives into are labelled with the expert's way out of them.
    reachable = planner.labelable(poses[times, :2])
    # Where the named object is drawn in each query's current frame: the target of the Stage-II view-grounding
    # head (models.wnm.goal_probe.ObjectViewProbe), computed here because only the simulator knows the scene.
    bearing, reach = object_sightings(plan, poses[times], obj_index, cfg.camera)
    in_view = {t: (b, d) for t, b, d in zip(times, bearing, reach, strict=True)}
    face = plan.furniture_centre(obj_index) if cfg.face_goal_object else None
    for t in (t for t, ok in zip(times, reachable, strict=True) if ok):
        if cfg.label_expert == "search":
            seen = seen_in_history(plan, poses, t, obj_index, cfg.history_frames, cfg.camera)
            ref_poses, ref_stop = search_continuation(
                plan, planner, obj_index, poses[t], seen, cfg.horizon, cfg.camera, face
            )
        else:
            ref_poses, ref_stop = planner.continuation(poses[t], cfg.horizon, face)
        events = label_query(occ, goal, poses[t], ref_stop, cfg.success_radius, cfg.events)
        name = f"ref_{t}.mp4"
        references[t] = renderer.render(ref_poses)
        queries.append(
            {
                "t": t,
                "reference_poses": _floats(ref_poses),
                "reference_stop": [int(v) for v in ref_stop],
                "reference_video": name,
                "events": events,
                "goal_object_bearing": None if math.isnan(in_view[t][0]) else float(in_view[t][0]),
                "goal_object_distance": None if math.isnan(in_view[t][1]) else float(in_view[t][1]),
            }
        )
    record = {
        "episode_id": episode_id,
        "scene_id": plan.scene_id,
        "instructions": instructions,
        "goal": _floats(goal),
        "goal_object": {"name": obj.name, "kind": obj.kind, "colour": obj.colour, "room": room},
        "success_radius": cfg.success_radius,
        "video": "rgb.mp4",
        "poses": _floats(poses),
        "policy_stopped": bool(stopped),
        "queries": queries,
    }
    if policy_info is not None:
        record["behaviour"] = policy_info
    return Episode(record=record, frames=renderer.render(poses) if frames is None else frames, references=references)


def write_episode(episode: Episode, episodes_dir: Path, fps: int) -> Path:
    """Writes ``<episodes_dir>/<episode_id>/`` (videos first, ``episode.json`` last)."""
    out = Path(episodes_dir) / episode.record["episode_id"]
    out.mkdir(parents=True, exist_ok=False)
    write_video(out / episode.record["video"], episode.frames, fps)
    for q in episode.record["queries"]:
        write_video(out / q["reference_video"], episode.references[q["t"]], fps)
    tmp = out / "episode.json.tmp"
    tmp.write_text(json.dumps(episode.record, indent=1) + "\n")
    tmp.replace(out / "episode.json")
    return out


@dataclass(frozen=True)
class SynthesisConfig:
    """Everything that defines a synthetic collection besides its seed.

    Attributes:
        num_scenes: Number of scenes.
        episodes_per_scene: Episodes per scene.
        floorplan: Floor-plan generator parameters.
        collector: Episode collection parameters.
        plan_attempts: Floor plans tried per scene before giving up.
        goal_variants: Goals each driven episode is labelled for (1: its own; K: also K - 1 other objects of the
            scene, see :func:`goal_variant_episodes`).
    """

    num_scenes: int = 4
    episodes_per_scene: int = 3
    floorplan: FloorPlanConfig = field(default_factory=FloorPlanConfig)
    collector: CollectorConfig = field(default_factory=CollectorConfig)
    plan_attempts: int = 5
    goal_variants: int = 1

    def __post_init__(self) -> None:
        if self.goal_variants < 1:
            raise ValueError(f"SynthesisConfig.goal_variants: must be >= 1, got {self.goal_variants}")
        if self.num_scenes < 1:
            raise ValueError(f"SynthesisConfig.num_scenes: must be >= 1, got {self.num_scenes}")
        if self.episodes_per_scene < 1:
            raise ValueError(f"SynthesisConfig.episodes_per_scene: must be >= 1, got {self.episodes_per_scene}")
        if self.plan_attempts < 1:
            raise ValueError(f"SynthesisConfig.plan_attempts: must be >= 1, got {self.plan_attempts}")
        if self.floorplan.robot_radius != self.collector.planner.robot_radius:
            raise ValueError("SynthesisConfig: floorplan.robot_radius must equal collector.planner.robot_radius")

    def collection_meta(self, seed: int) -> dict:
        """The ``collection.json`` content."""
        cam = self.collector.camera
        return {
            "format": COLLECTION_FORMAT,
            "fps": self.collector.fps,
            "image_size": [cam.height, cam.width],
            "policy": {"type": "noisy-expert", **asdict(self.collector.policy)},
            "seed": int(seed),
            "num_scenes": self.num_scenes,
            "num_episodes": self.num_scenes * self.episodes_per_scene,
            "goal_variants": self.goal_variants,
            "label_expert": self.collector.label_expert,
            "face_goal_object": self.collector.face_goal_object,
            "goal_point": self.collector.goal_point,
            "history_frames": self.collector.history_frames,
            "target_frames": self.collector.target_frames,
            "generator": {
                "name": "verl_omni.sim",
                "floorplan": asdict(self.floorplan),
                "planner": asdict(self.collector.planner),
                "events": asdict(self.collector.events),
                "camera": asdict(cam),
            },
        }


def scene_id_of(index: int) -> str:
    return f"s{index:04d}"


def synthesize_scene(
    scene_index: int, seed: int, cfg: SynthesisConfig, episodes_dir: Path, occupancy_root: Path
) -> dict:
    """Generates one scene and its episodes and writes them.

    Args:
        scene_index: Index of the scene in the collection.
        seed: Collection seed; the scene's randomness is ``SeedSequence([seed, scene_index])``.
        cfg: Synthesis parameters.
        episodes_dir: ``<collection>/episodes``.
        occupancy_root: Folder receiving ``<scene_id>/occupancy.*``.

    Returns:
        Summary counts: ``scene_id``, ``episodes``, ``queries``, ``frames``, ``events`` (per type).

    Raises:
        SceneError: the scene cannot be generated or cannot host an episode.
    """
    scene_id = scene_id_of(scene_index)
    seq = np.random.SeedSequence([int(seed), int(scene_index)])
    plan_seq, *episode_seqs = seq.spawn(1 + cfg.episodes_per_scene)
    plan_rng = np.random.default_rng(plan_seq)
    plan, last_error = None, None
    for _ in range(cfg.plan_attempts):
        try:
            plan = check_plan_has_goals(generate_floor_plan(cfg.floorplan, plan_rng, scene_id=scene_id), cfg.collector)
            break
        except FloorPlanError as e:
            last_error = e
    if plan is None:
        raise SceneError(f"scene {scene_id}: floor plan failed {cfg.plan_attempts} times: {last_error}")
    cc = cfg.collector
    occ = plan.occupancy()
    if not occ.free.any():
        raise SceneError(f"scene {scene_id}: the floor plan has no free space")
    renderer = Renderer(plan, cc.camera)
    # Any goal serves to build the shared inflated maps; the first furniture goal candidate is used.
    try:
        seed_goal = next(
            c[0]
            for f in plan.furniture
            if len(c := goal_candidates(plan, f.index, cc.planner, cc.goal_object_distance_m))
        )
    except StopIteration:
        raise SceneError(f"scene {scene_id}: no furniture has free space around it for a goal") from None
    try:
        base = ExpertPlanner(occ, seed_goal, cc.planner)
    except PlanningError as e:
        raise SceneError(str(e)) from e
    episodes = []
    for k, eseq in enumerate(episode_seqs):
        episode = collect_episode(plan, renderer, base, f"{scene_id}_e{k:03d}", cc, np.random.default_rng(eseq))
        episodes.append(episode)
        if cfg.goal_variants > 1:
            from verl_omni.sim.goal_variants import goal_variant_episodes  # builds on this module's labelling

            key = [int(seed), int(scene_index), k]
            episodes += goal_variant_episodes(plan, renderer, base, episode, cfg.goal_variants - 1, cc, key)
    plan.save(Path(occupancy_root) / scene_id)
    events: Counter = Counter()
    frames = queries = 0
    for episode in episodes:
        write_episode(episode, episodes_dir, cc.fps)
        frames += len(episode.frames) + sum(len(r) for r in episode.references.values())
        queries += len(episode.record["queries"])
        for q in episode.record["queries"]:
            events.update(q["events"])
    return {
        "scene_id": scene_id,
        "episodes": len(episodes),
        "queries": queries,
        "frames": frames,
        "events": {e: int(events.get(e, 0)) for e in EVENT_NAMES},
    }


def synthesize_scene_job(job: tuple[int, int, SynthesisConfig, str, str]) -> dict:
    """``synthesize_scene`` on one tuple ``(scene_index, seed, cfg, episodes_dir, occupancy_root)``.

    A module-level function so that process pools can pickle it by name.
    """
    index, seed, cfg, episodes_dir, occupancy_root = job
    return synthesize_scene(index, seed, cfg, Path(episodes_dir), Path(occupancy_root))
