"""Closed-loop DAgger collection: a learned WNM policy drives, the expert relabels.

One round of DAgger (Ross et al., 2011) as Stage II uses it: the behaviour policy mixes the learner with the
expert: at every policy call of every episode the next chunk follows the expert with probability ``beta``
and the learner otherwise (a draw keyed by the episode and call, so a round is reproducible). The robot is
driven in closed loop by the same receding-horizon loop the evaluator uses (``run_closed_loop``); every
visited trajectory is then relabelled with the expert's continuations at its query states
(``collector.label_episode``) and written in the GN0 collection format, so SFT, the converter and the
Stage-III tools read a DAgger round exactly like a synthesized collection. A schedule lowers ``beta`` over
rounds (``beta_schedule``).

The learner runs batched over all active episodes in this process (on the GPU when it is given one); scene
generation and the relabelling/rendering/encoding of finished episodes run in ``workers`` processes.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from verl_omni.sim.closed_loop import ClosedLoopConfig, EpisodeSpec, PolicyQuery
from verl_omni.sim.collector import (
    COLLECTION_FORMAT,
    SceneError,
    SynthesisConfig,
    check_plan_has_goals,
    label_episode,
    sample_task,
    scene_id_of,
    write_episode,
)
from verl_omni.sim.events import EVENT_NAMES
from verl_omni.sim.floorplan import FloorPlan, FloorPlanError, generate_floor_plan
from verl_omni.sim.heldout import _base_planner
from verl_omni.sim.instructions import make_instructions
from verl_omni.sim.parallel import map_jobs
from verl_omni.sim.reference_policies import ExpertPolicy
from verl_omni.sim.render import Renderer

DAGGER_STREAM = 0x44414747  # separates DAgger draws from the synthesizer's and the evaluator's


def beta_schedule(rounds: int, beta0: float = 1.0, decay: float = 0.5) -> list[float]:
    """Expert-mixing probability per round: ``beta0 * decay**r`` (round 0 with ``beta0 = 1`` is pure expert).

    Raises:
        ValueError: ``rounds < 1`` or a probability outside [0, 1].
    """
    if rounds < 1 or not 0.0 <= beta0 <= 1.0 or not 0.0 <= decay <= 1.0:
        raise ValueError(f"beta_schedule: needs rounds >= 1 and beta0, decay in [0, 1], got {rounds}, {beta0}, {decay}")
    return [beta0 * decay**r for r in range(rounds)]


class MixedPolicy:
    """The DAgger behaviour policy: per call and episode, the expert's chunk with probability ``beta``.

    Args:
        learner: The learned policy (``image_size``, ``history_frames``, ``act``).
        expert: The scripted expert over the same scenes.
        beta: Probability that a call follows the expert.
        seed: Seed of the draws.
    """

    def __init__(self, learner, expert: ExpertPolicy, beta: float, seed: int) -> None:
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"MixedPolicy: beta must be in [0, 1], got {beta}")
        self.learner, self.expert, self.beta, self.seed = learner, expert, float(beta), int(seed)
        self.image_size = tuple(learner.image_size)
        self.history_frames = int(learner.history_frames)
        self.expert_calls: Counter = Counter()
        self.learner_calls: Counter = Counter()

    def follows_expert(self, query: PolicyQuery) -> bool:
        """The draw of one call (a pure function of seed, episode and call index)."""
        if self.beta >= 1.0:
            return True
        if self.beta <= 0.0:
            return False
        key = [self.seed, DAGGER_STREAM, zlib.crc32(query.episode_id.encode()), int(query.call_index)]
        return bool(np.random.default_rng(np.random.SeedSequence(key)).random() < self.beta)

    def act(self, history: np.ndarray, queries: Sequence[PolicyQuery]) -> np.ndarray:
        """``[B, 32, 4]`` actions: expert rows where the draw says so, the learner's batched call elsewhere."""
        use_expert = np.array([self.follows_expert(q) for q in queries], bool)
        out = np.zeros((len(queries), 32, 4))
        if use_expert.any():
            idx = np.nonzero(use_expert)[0]
            out[idx] = self.expert.act(history[idx], [queries[i] for i in idx])
            self.expert_calls.update(queries[i].episode_id for i in idx)
        if (~use_expert).any():
            idx = np.nonzero(~use_expert)[0]
            acts = np.asarray(self.learner.act(history[idx], [queries[i] for i in idx]), np.float64)
            out[idx] = acts[:, :32]
            self.learner_calls.update(queries[i].episode_id for i in idx)
        return out

    def episode_info(self, episode_id: str) -> dict:
        """Calls of one episode that followed the expert and the learner."""
        return {
            "expert_calls": int(self.expert_calls[episode_id]),
            "learner_calls": int(self.learner_calls[episode_id]),
        }


def build_mixed_policy(learner_factory, plans, beta: float, seed: int, planner, image_size) -> MixedPolicy:
    """A :class:`MixedPolicy` around a freshly built learner (what each driving worker process calls).

    Raises:
        ValueError: the learner sees frames of another size than the collection renders.
    """
    learner = learner_factory()
    if tuple(learner.image_size) != tuple(image_size):
        raise ValueError(
            f"DAgger: the policy sees {list(learner.image_size)} frames but the collection renders "
            f"{list(image_size)}; pass a matching --image-size"
        )
    expert = ExpertPolicy(plans, stop=True, image_size=tuple(image_size), planner=planner)
    return MixedPolicy(learner, expert, beta, seed)


@dataclass(frozen=True)
class DaggerTask:
    """One episode to drive: the evaluator's spec plus what the record needs."""

    spec: EpisodeSpec
    obj_index: int
    instructions: tuple[str, ...]


def make_scene(index: int, seed: int, cfg: SynthesisConfig) -> FloorPlan:
    """The training scene ``s<index>`` of a seed, drawn like the synthesizer draws it.

    Raises:
        SceneError: the floor plan fails ``cfg.plan_attempts`` times.
    """
    seq = np.random.SeedSequence([int(seed), int(index)])
    plan_rng = np.random.default_rng(seq.spawn(1)[0])
    last = None
    for _ in range(cfg.plan_attempts):
        try:
            plan = generate_floor_plan(cfg.floorplan, plan_rng, scene_id=scene_id_of(index))
            return check_plan_has_goals(plan, cfg.collector)
        except FloorPlanError as e:
            last = e
    raise SceneError(f"scene {scene_id_of(index)}: floor plan failed {cfg.plan_attempts} times: {last}")


def sample_tasks(plans: Sequence[FloorPlan], episodes_per_scene: int, seed: int, cfg: SynthesisConfig) -> list:
    """Goal, start and instructions of every episode (``<scene>_d<k>``), from the DAgger seed stream."""
    cc = cfg.collector
    tasks = []
    for plan in plans:
        base = _base_planner(plan, cc)
        for k in range(episodes_per_scene):
            rng = np.random.default_rng(
                np.random.SeedSequence([int(seed), DAGGER_STREAM, zlib.crc32(plan.scene_id.encode()), k])
            )
            obj_index, goal, planner, start = sample_task(plan, base, cc, rng)
            obj = plan.furniture[obj_index]
            instructions = make_instructions(plan.rooms[obj.room].kind, obj.name, cc.num_instructions, rng)
            spec = EpisodeSpec(
                episode_id=f"{plan.scene_id}_d{k:03d}",
                scene_id=plan.scene_id,
                start_pose=tuple(start),
                goal=tuple(goal),
                instruction=instructions[0],
                success_radius=cc.success_radius,
                shortest_path_m=max(float(planner.distance(start[:2])), 1e-6),
                seed=int(rng.integers(0, 2**31 - 1)),
                goal_object=obj.name,
            )
            tasks.append(DaggerTask(spec, obj_index, tuple(instructions)))
    return tasks


def _label_job(job: tuple) -> dict:
    """Relabels and writes one episode (a module-level function so process pools can pickle it)."""
    plan, task, poses, blocked, stopped, info, cfg, episodes_dir = job
    cc = cfg.collector
    renderer = Renderer(plan, cc.camera)
    planner = _base_planner(plan, cc).retarget(np.asarray(task.spec.goal))
    # Frames right after a refused (blocked) step are the learner's close calls: extra query states there.
    close = sorted({int(i) + 1 for i in np.nonzero(np.asarray(blocked, bool))[0]})
    episode = label_episode(
        plan, renderer, planner, task.spec.episode_id, task.obj_index, list(task.instructions), poses, close,
        stopped, cc, policy_info=info,
    )  # fmt: skip
    write_episode(episode, Path(episodes_dir), cc.fps)
    events: Counter = Counter()
    for q in episode.record["queries"]:
        events.update(q["events"])
    queried = {q["t"] for q in episode.record["queries"]}
    return {
        "queries": len(episode.record["queries"]),
        "frames": len(episode.frames),
        "events": dict(events),
        "close_calls": len(close),
        "close_calls_labelled": sum(t in queried for t in close),
    }


def collect_dagger_round(
    learner_factory,
    cfg: SynthesisConfig,
    seed: int,
    beta: float,
    episodes_dir: Path,
    occupancy_root: Path,
    workers: int = 1,
    scene_offset: int = 0,
    max_steps: int | None = None,
    progress: bool = True,
    drive_workers: int = 1,
    execute_steps: int = 8,
) -> dict:
    """Drives ``cfg.num_scenes x cfg.episodes_per_scene`` episodes with the mixed policy and writes them.

    Args:
        learner_factory: Picklable zero-argument callable building the learned policy (e.g.
            ``functools.partial(WNMPolicy.from_checkpoint, path, device="cuda")``); every driving process
            builds its own.
        cfg: Scenes, episodes per scene, floor-plan and collector settings.
        seed: Seed of scenes, tasks and mixing draws.
        beta: Probability that a call follows the expert.
        episodes_dir / occupancy_root: Output folders (``<collection>/episodes`` and the occupancy scenes).
        workers: Processes for relabelling and writing.
        scene_offset: Index of the first scene (rounds may use fresh scenes: ``s<offset> ...``).
        max_steps: Motion steps per episode (default: the collector's ``policy.max_steps``).
        progress: Show progress bars.
        drive_workers: Processes driving episodes, each with its own learner (:mod:`verl_omni.sim.loop_pool`).
        execute_steps: Action steps the behaviour policy executes per call before it is asked again (8, one
            chunk; fewer replans more often, as the learner may be deployed).

    Returns:
        Summary: episodes, queries, frames, events, the behaviour's expert share, the learner's SR on the round.
    """
    import functools

    from verl_omni.sim.loop_pool import run_closed_loop_pool

    plans = [make_scene(scene_offset + i, seed, cfg) for i in range(cfg.num_scenes)]
    for plan in plans:
        plan.save(Path(occupancy_root) / plan.scene_id)
    tasks = sample_tasks(plans, cfg.episodes_per_scene, seed, cfg)
    by_id = {p.scene_id: p for p in plans}
    image_size = (cfg.collector.camera.height, cfg.collector.camera.width)
    factory = functools.partial(build_mixed_policy, learner_factory, by_id, beta, seed, cfg.collector.planner,
                                image_size)  # fmt: skip
    loop = ClosedLoopConfig(
        max_steps=max_steps or cfg.collector.policy.max_steps,
        robot_radius=cfg.collector.planner.robot_radius,
        fov_deg=cfg.collector.camera.fov_deg,
        execute_steps=execute_steps,
    )
    results, calls = run_closed_loop_pool(factory, by_id, [t.spec for t in tasks], loop, drive_workers, progress,
                                          "drive")  # fmt: skip
    jobs = []
    for task, res in zip(tasks, results, strict=True):
        eid = task.spec.episode_id
        info = {
            "type": "dagger",
            "beta": beta,
            "expert_calls": calls[eid]["expert_calls"],
            "learner_calls": calls[eid]["learner_calls"],
            "success": bool(res.success),
            "end_reason": res.end_reason,
            # Motion steps whose translation the simulator refused (step i moves frame i to frame i + 1): the
            # learner's contacts, kept so a later relabelling or analysis need not guess them from the poses.
            "blocked_steps": [int(i) for i in np.nonzero(np.asarray(res.blocked, bool))[0]],
        }
        jobs.append((by_id[task.spec.scene_id], task, res.poses, res.blocked, res.end_reason == "stop", info, cfg,
                     str(episodes_dir)))  # fmt: skip
    summaries = map_jobs(_label_job, jobs, workers, desc="relabel", unit="ep", progress=progress)
    events: Counter = Counter()
    for s in summaries:
        events.update(s["events"])
    calls_e = sum(c["expert_calls"] for c in calls.values())
    calls_l = sum(c["learner_calls"] for c in calls.values())
    learner_only = [r for r in results if calls[r.episode_id]["expert_calls"] == 0]
    return {
        "episodes": len(results),
        "execute_steps": execute_steps,
        "queries": sum(s["queries"] for s in summaries),
        "frames": sum(s["frames"] for s in summaries),
        "events": {e: int(events.get(e, 0)) for e in EVENT_NAMES},
        # Frames right after a refused step, and how many of them the expert labelled (all but those it cannot
        # plan from; before the planner's escape, every contact closer than its thin band was dropped).
        "close_calls": sum(s["close_calls"] for s in summaries),
        "close_calls_labelled": sum(s["close_calls_labelled"] for s in summaries),
        "expert_call_share": calls_e / max(1, calls_e + calls_l),
        "behaviour_success_rate": float(np.mean([r.success for r in results])),
        "learner_only_episodes": len(learner_only),
        # None, not NaN, when no episode was driven by the learner alone: collection.json must stay strict JSON
        # (the converter's manifest refuses NaN).
        "learner_only_success_rate": float(np.mean([r.success for r in learner_only])) if learner_only else None,
    }


def dagger_collection_meta(cfg: SynthesisConfig, seed: int, beta: float, checkpoint_info: dict) -> dict:
    """``collection.json`` of a DAgger round (the synthesizer's fields, with the behaviour policy named)."""
    meta = cfg.collection_meta(seed)
    meta["format"] = COLLECTION_FORMAT
    meta["policy"] = {"type": "dagger", "beta": float(beta), "learner": checkpoint_info}
    return meta


def write_collection_meta(path: Path, meta: dict) -> None:
    tmp = Path(path).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    tmp.replace(path)
