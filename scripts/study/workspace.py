"""Builds the study's workspace with the real user commands, and the slim copy of it that travels to the GPU.

``build_full`` runs, in order: ``synthesize_gn0_collection.py`` (training collection + occupancy scenes),
``make_tiny_wnm_checkpoint.py --collection --sft-steps`` (the Stage-II stand-in), the converter, the
training-subset sampler and the event-val builder, then writes held-out evaluation scenes from the
evaluator's own held-out seed stream (``verl_omni.sim.heldout``), which never yields a training scene.

With a Stage-II checkpoint given (``WorkspaceSettings.stage2_checkpoint``, e.g. a ``scripts/train_stage2.py``
DAgger round), no stand-in is trained: the checkpoint is copied in and the Stage-III collection is gathered with
it as the behaviour policy (``tools/data/collect_dagger.py``: the policy drives, mixed with the expert at
``behaviour_beta``, and the expert relabels every visited query state, so the rewards' references are the
expert's continuations from the states that policy reaches), on the checkpoint's task level and goal rule.

``pack_carry`` copies what a training run and the evaluator read (checkpoint, training and validation
Parquet with their manifests, occupancy scenes, held-out scenes and only the videos the Parquet rows
reference) into ``carry/``, with a ``workspace.json`` of paths relative to it. ``relocate`` points the
manifests' ``source_root``/``occupancy_root`` at wherever the carried folder now lives.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from verl_omni.sim.label_args import label_flags

from .plan import REPO

CARRY_FORMAT = "wnm-stage3-study-workspace/1"


@dataclass(frozen=True)
class WorkspaceSettings:
    """Sizes of the study workspace.

    Attributes:
        scenes / episodes_per_scene: Training collection size.
        collection_seed: Seed of the training collection.
        sft_steps / sft_max_queries / sft_batch_size / sft_lr / sft_action_weight: Stage-II stand-in training.
        train_size: Training prompts (at most one per episode; a multiple of the prompt batch).
        per_event: Validation rows per event type.
        heldout_scenes / heldout_seed: Held-out evaluation scenes.
        workers: Worker processes of the data commands.
        stage2_checkpoint: A trained Stage-II checkpoint to start from ("" = train the tiny stand-in above; the
            ``sft_*`` fields are then unused).
        level / goal_point / face_goal_object: Task of the collection and of the held-out scenes
            (``verl_omni.sim.levels``; ``house``/``random`` is the stand-in study's).
        behaviour_beta: With ``stage2_checkpoint``: probability that a policy call of the collection follows the
            expert instead of the checkpoint (0 = the checkpoint alone).
        behaviour_execute_steps: With ``stage2_checkpoint``: action steps the behaviour policy executes per call.
        behaviour_max_steps / behaviour_num_steps: With ``stage2_checkpoint``: motion steps per collected episode
            and ODE steps of the behaviour policy (``collect_dagger.py --max-steps / --num-steps``).
        device: Torch device of the behaviour policy.
        prompt_event_share: ``EVENT=SHARE`` (e.g. ``collision_precursor=0.25``): that share of the training
            prompts is taken from query states with the event (``sample_stage3_train.py --event-share``); "" =
            one uniformly chosen state per episode.
    """

    scenes: int = 8
    episodes_per_scene: int = 6
    collection_seed: int = 11
    sft_steps: int = 1000
    sft_max_queries: int = 480
    sft_batch_size: int = 8
    sft_lr: float = 1e-3
    sft_action_weight: float = 2.0
    train_size: int = 32
    per_event: int = 3
    heldout_scenes: int = 8
    heldout_seed: int = 5
    workers: int = 2
    stage2_checkpoint: str = ""
    level: str = "house"
    goal_point: str = "random"
    face_goal_object: bool = False
    behaviour_beta: float = 0.5
    behaviour_execute_steps: int = 3
    behaviour_max_steps: int = 160
    behaviour_num_steps: int = 10
    device: str = "cpu"
    prompt_event_share: str = ""

    def __post_init__(self) -> None:
        from verl_omni.sim.levels import LEVELS

        names = ("scenes", "episodes_per_scene", "train_size", "per_event", "heldout_scenes", "workers")
        for name in (*names, "behaviour_execute_steps", "behaviour_max_steps", "behaviour_num_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"WorkspaceSettings.{name}: must be >= 1, got {getattr(self, name)}")
        if self.level not in LEVELS:
            raise ValueError(f"WorkspaceSettings.level: {self.level!r} is not a task level; known: {sorted(LEVELS)}")
        if self.goal_point not in ("random", "nearest"):
            raise ValueError(f"WorkspaceSettings.goal_point: must be random or nearest, got {self.goal_point!r}")
        if not 0.0 <= self.behaviour_beta <= 1.0:
            raise ValueError(f"WorkspaceSettings.behaviour_beta: must be in [0, 1], got {self.behaviour_beta}")
        if self.stage2_checkpoint and not (Path(self.stage2_checkpoint) / "checkpoint_manifest.json").is_file():
            raise ValueError(
                f"WorkspaceSettings.stage2_checkpoint: {self.stage2_checkpoint} is not a complete WNM checkpoint (no "
                "checkpoint_manifest.json); pass the folder of a scripts/train_stage2.py round"
            )
        if self.sft_steps < 0:
            raise ValueError(f"WorkspaceSettings.sft_steps: must be >= 0, got {self.sft_steps}")
        if self.prompt_event_share:
            from verl_omni.data.schema import EVENT_NAMES

            event, sep, share = self.prompt_event_share.partition("=")
            try:
                ok = bool(sep) and event in EVENT_NAMES and 0.0 < float(share) <= 1.0
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(
                    f"WorkspaceSettings.prompt_event_share: {self.prompt_event_share!r}; expected EVENT=SHARE with "
                    f"EVENT one of {list(EVENT_NAMES)} and SHARE in (0, 1]"
                )
        if self.train_size >= self.scenes * self.episodes_per_scene:
            raise ValueError(
                f"WorkspaceSettings.train_size: {self.train_size} leaves no episode of the "
                f"{self.scenes * self.episodes_per_scene} for validation (one training row per episode)"
            )


def run_tool(args: list[str], log: Path) -> None:
    """Runs a repo command with this interpreter, appending its output to ``log``.

    Raises:
        RuntimeError: the command failed (names it and the log).
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(args)}\n")
        f.flush()
        proc = subprocess.run([sys.executable, *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{args[0]} failed with exit code {proc.returncode}; see {log}:\n{tail}")


def _task_flags(s: WorkspaceSettings) -> list[str]:
    """Level and goal-rule flags of the data commands (none at the stand-in study's defaults, as before)."""
    if (s.level, s.goal_point, s.face_goal_object) == ("house", "random", False):
        return []
    return ["--level", s.level, *label_flags("map", s.face_goal_object, s.goal_point)]


def _stand_in_steps(ws: dict[str, Path], s: WorkspaceSettings) -> list[tuple[str, list[str]]]:
    """A synthesized noisy-expert collection and the tiny Stage-II stand-in trained on it."""
    return [
        (
            "synthesize",
            [
                "tools/data/synthesize_gn0_collection.py",
                *("--output-dir", str(ws["collection"]), "--occupancy-dir", str(ws["scenes"])),
                *("--num-scenes", str(s.scenes), "--episodes-per-scene", str(s.episodes_per_scene)),
                *("--seed", str(s.collection_seed), "--image-size", "64", "--workers", str(s.workers)),
                *_task_flags(s),
            ],
        ),
        (
            "stage-II stand-in",
            [
                "tools/checkpoint/make_tiny_wnm_checkpoint.py",
                *("--output-dir", str(ws["ckpt"]), "--collection", str(ws["collection"])),
                *("--sft-steps", str(s.sft_steps), "--max-queries", str(s.sft_max_queries)),
                *("--batch-size", str(s.sft_batch_size), "--lr", str(s.sft_lr)),
                *("--action-weight", str(s.sft_action_weight), "--eval-every", "100", "--no-progress"),
            ],
        ),
    ]


def _stage2_steps(ws: dict[str, Path], s: WorkspaceSettings) -> list[tuple[str, list[str]]]:
    """The given Stage-II checkpoint, copied in, drives the Stage-III collection (expert-relabelled)."""
    src = Path(s.stage2_checkpoint)
    print(f"== stage-II checkpoint: {src}", flush=True)
    shutil.copytree(src, ws["ckpt"])
    return [
        (
            "collect with the stage-II policy",
            [
                "tools/data/collect_dagger.py",
                *("--policy-checkpoint", str(ws["ckpt"]), "--beta", str(s.behaviour_beta)),
                *("--execute-steps", str(s.behaviour_execute_steps), "--device", s.device),
                *("--max-steps", str(s.behaviour_max_steps), "--num-steps", str(s.behaviour_num_steps)),
                *("--output-dir", str(ws["collection"]), "--occupancy-dir", str(ws["scenes"])),
                *("--num-scenes", str(s.scenes), "--episodes-per-scene", str(s.episodes_per_scene)),
                *("--seed", str(s.collection_seed), "--workers", str(s.workers), "--no-progress"),
                *_task_flags(s),
            ],
        ),
    ]


def build_full(root: Path, s: WorkspaceSettings, log: Path) -> dict[str, Path]:
    """Builds the complete workspace under ``root`` (must not exist). Returns its paths."""
    from verl_omni.sim.collector import CollectorConfig
    from verl_omni.sim.floorplan import FloorPlanConfig
    from verl_omni.sim.heldout import synthesize_heldout_scenes
    from verl_omni.sim.levels import get_level

    ws = {k: root / k for k in ("collection", "scenes", "ckpt", "converted", "train", "eventval", "heldout_scenes")}
    root.mkdir(parents=True)
    steps = _stage2_steps(ws, s) if s.stage2_checkpoint else _stand_in_steps(ws, s)
    steps += [
        (
            "convert",
            [
                "tools/data/convert_interiorgs_dagger_to_rlhf.py",
                *("--input-root", str(ws["collection"]), "--output-dir", str(ws["converted"])),
                *("--checkpoint", str(ws["ckpt"]), "--occupancy-root", str(ws["scenes"])),
                *("--shard-size", "4096", "--val-fraction", "0", "--split-seed", "42"),
                *("--workers", str(s.workers), "--worker-prefetch", "2"),
            ],
        ),
        (
            "sample",
            [
                "tools/data/sample_stage3_train.py",
                *("--source-manifest", str(ws["converted"] / "manifest.json"), "--output-dir", str(ws["train"])),
                *("--train-size", str(s.train_size), "--shard-size", "4096", "--seed", "42"),
                *(("--event-share", s.prompt_event_share) if s.prompt_event_share else ()),
            ],
        ),
        (
            "event val",
            [
                "tools/data/build_vggt_stage3_event_val.py",
                *("--input-root", str(ws["collection"]), "--output-dir", str(ws["eventval"])),
                *("--checkpoint", str(ws["ckpt"]), "--exclude-parquet-dir", str(ws["train"])),
                *("--occupancy-root", str(ws["scenes"]), "--per-event", str(s.per_event)),
                *("--workers", str(s.workers)),
            ],
        ),
    ]
    for label, args in steps:
        print(f"== {label}: {' '.join(args[:1])}", flush=True)
        run_tool(args, log)
    print("== held-out scenes", flush=True)
    if s.level == "house" and s.goal_point == "random":
        plans = synthesize_heldout_scenes(s.heldout_scenes, s.heldout_seed, FloorPlanConfig())
    else:  # the evaluator's own draw for a level (closed_loop_eval.py --synthesize --level --goal-point)
        level = get_level(s.level)
        task = CollectorConfig(min_goal_distance_m=level.min_goal_distance_m, goal_point=s.goal_point)
        plans = synthesize_heldout_scenes(s.heldout_scenes, s.heldout_seed, level.floorplan(), task=task)
    for plan in plans:
        plan.save(ws["heldout_scenes"] / plan.scene_id)
    return ws


def referenced_videos(dataset_dir: Path) -> set[str]:
    """Collection-relative video paths the rows of a dataset reference (history and target)."""
    from verl_omni.data.dataset import Stage3Dataset

    ds = Stage3Dataset.open(dataset_dir)
    return {v for i in range(len(ds)) for v in (ds[i].history_video, ds[i].target_video)}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def pack_carry(full: dict[str, Path], carry: Path, settings: WorkspaceSettings) -> dict:
    """Copies what the GPU run needs into ``carry`` (must not exist); returns the workspace description."""
    tmp = carry.with_name(carry.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for key in ("ckpt", "scenes", "train", "eventval", "heldout_scenes"):
        shutil.copytree(full[key], tmp / key)
    videos = referenced_videos(full["train"]) | referenced_videos(full["eventval"])
    src = full["collection"]
    (tmp / "collection").mkdir()
    shutil.copy2(src / "collection.json", tmp / "collection" / "collection.json")
    for rel in sorted(videos):
        dest = tmp / "collection" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, dest)
    from verl_omni.data.dataset import Stage3Dataset

    desc = {
        "format": CARRY_FORMAT,
        "paths": {
            "ckpt": "ckpt",
            "collection": "collection",
            "scenes": "scenes",
            "train": "train",
            "eventval": "eventval",
            "heldout_scenes": "heldout_scenes",
        },
        "train_size": len(Stage3Dataset.open(full["train"])),
        "val_rows": len(Stage3Dataset.open(full["eventval"])),
        "videos": len(videos),
        "settings": asdict(settings),
    }
    (tmp / "workspace.json").write_text(json.dumps(desc, indent=1) + "\n")
    tmp.rename(carry)
    relocate(carry, desc)  # after the rename, so the manifests name the final folder
    return desc


def write_carry_archive(carry: Path, dest: Path) -> int:
    """``carry`` as one tar.xz (``carry/`` inside), written atomically; returns its size in bytes.

    One compressed file is what travels: xz takes ~10% off the float weights, and a single path is easy to
    name in a carry list.
    """
    import tarfile

    if dest.exists():
        raise FileExistsError(f"{dest}: already exists; never overwritten")
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    with tarfile.open(tmp, "w:xz", preset=6) as tar:
        tar.add(carry, arcname="carry")
    tmp.rename(dest)
    return dest.stat().st_size


def extract_carry_archive(archive: Path, carry: Path) -> None:
    """Unpacks :func:`write_carry_archive` output into ``carry`` (must not exist)."""
    import tarfile

    tmp = carry.with_name(carry.name + ".extracting")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(tmp, filter="data")
    if not (tmp / "carry" / "workspace.json").is_file():
        shutil.rmtree(tmp)
        raise ValueError(f"{archive}: no carry/workspace.json inside; rebuild it with `study_stage3.py prepare`")
    (tmp / "carry").rename(carry)
    tmp.rmdir()


def load_carry(carry: Path) -> dict:
    """Reads ``carry/workspace.json``; returns absolute paths plus ``train_size``.

    Raises:
        FileNotFoundError / ValueError: missing or foreign workspace description (names the file).
    """
    f = carry / "workspace.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f}: not found; run `scripts/study_stage3.py prepare --workdir ...` first")
    desc = json.loads(f.read_text())
    if desc.get("format") != CARRY_FORMAT:
        raise ValueError(f"{f}: field 'format' is {desc.get('format')!r}, expected {CARRY_FORMAT!r}")
    ws = {k: (carry / v).resolve() for k, v in desc["paths"].items()}
    missing = [str(p) for p in ws.values() if not p.exists()]
    if missing:
        raise FileNotFoundError(f"{f}: listed folders missing: {missing}; carry the whole folder {carry}")
    ws["train_size"] = int(desc["train_size"])
    ws["val_rows"] = int(desc["val_rows"])
    ws["desc"] = desc
    return ws


def relocate(carry: Path, desc: dict) -> list[Path]:
    """Points the carried manifests' ``source_root``/``occupancy_root`` at the carried folders.

    Manifests record absolute roots of the machine that built them; the shard hashes they protect are not
    touched. Returns the manifests rewritten (unchanged ones are left alone).
    """
    roots = {
        "source_root": str((carry / desc["paths"]["collection"]).resolve()),
        "occupancy_root": str((carry / desc["paths"]["scenes"]).resolve()),
    }
    changed = []
    for key in ("train", "eventval"):
        path = carry / desc["paths"][key] / "manifest.json"
        m = json.loads(path.read_text())
        if all(m.get(k) == v for k, v in roots.items()):
            continue
        m.update(roots)
        tmp = path.with_name(f".manifest.json.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(m, indent=2) + "\n")
        tmp.replace(path)
        changed.append(path)
    return changed
