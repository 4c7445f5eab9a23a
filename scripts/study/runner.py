"""Runs the study's trainings concurrently, then exports and evaluates each one as soon as it ends.

Each training run is its own process (``python -m verl_omni.trainer.main_stage3``) with its own Ray runtime
(``WAM_RAY_TMPDIR``, ``WAM_RAY_NAMESPACE`` per run), its own session (so its whole process group can be
stopped) and its own log. A run that fails does not stop the others. Per run the state moves
``pending -> training -> exporting -> evaluating -> done`` (or ``failed`` with the reason); ``status.json``
is rewritten atomically after every transition, so the results folder always describes what has completed.

Two wall-clock guards keep the study inside a fixed budget: at ``train_deadline_s`` each still-running trainer's
driver gets SIGTERM, finishes the step in progress, saves it as a checkpoint and shuts its Ray runtime down
(killed with its process group if it has not ended ``stop_grace_s`` later), and the run continues from its last
checkpoint; at ``deadline_s`` everything still running is stopped and recorded as timed out.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .plan import REPO

STAGE2 = "stage2"


@dataclass
class EvalSettings:
    """Closed-loop evaluation settings shared by every evaluated checkpoint (same episodes and noise).

    Attributes:
        episodes / max_steps / num_steps / seed / device / dtype: ``closed_loop_eval.py`` flags of the same names
            (``seed`` is the held-out seed: scenes, episodes and noise).
        synthesize: > 0: the evaluator draws this many held-out scenes itself (``--synthesize``, on ``level`` with
            ``goal_point``), the draw every other evaluation of that level and seed makes; 0: the carried scenes.
        level / goal_point: Task of the synthesized scenes and episodes.
        execute_steps: Action steps executed per policy call (8: whole chunks).
        stop_gate: Evaluate with the checkpoints' STOP gate (a Stage-III export carries its base's).
        workers: Processes per evaluation.
    """

    episodes: int = 96
    max_steps: int = 128
    num_steps: int = 10
    seed: int = 7
    device: str = "cpu"
    dtype: str = "float32"
    synthesize: int = 0
    level: str = "house"
    goal_point: str = "random"
    execute_steps: int = 8
    stop_gate: bool = False
    workers: int = 1

    def argv(self, scenes: Path) -> list[str]:
        where = (
            ["--synthesize", str(self.synthesize), "--level", self.level, "--goal-point", self.goal_point]
            if self.synthesize > 0
            else ["--scenes", str(scenes)]
        )
        return [
            *where,
            *("--episodes", str(self.episodes), "--max-steps", str(self.max_steps)),
            *("--num-steps", str(self.num_steps), "--seed", str(self.seed)),
            *("--device", self.device, "--dtype", self.dtype),
            *("--execute-steps", str(self.execute_steps), "--workers", str(self.workers)),
            *(["--stop-gate"] if self.stop_gate else []),
            "--no-progress",
        ]


@dataclass
class Job:
    """One subprocess with its log and its process group."""

    name: str
    argv: list[str]
    log: Path
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    started: float = 0.0
    ended: float = 0.0
    returncode: int | None = None
    signalled: bool = False

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONHASHSEED": "0", **self.env}
        with open(self.log, "ab") as f:
            f.write(f"$ {' '.join(self.argv)}\n".encode())
            f.flush()
            # A new session per job: its process group (Ray's raylet/GCS included) can be signalled as one.
            self.proc = subprocess.Popen(
                self.argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.started = time.time()

    def poll(self) -> int | None:
        if self.proc is None or self.returncode is not None:
            return self.returncode
        rc = self.proc.poll()
        if rc is not None:
            self.returncode, self.ended = rc, time.time()
        return rc

    def terminate(self) -> None:
        """SIGTERM to the job's process group (only this job's processes)."""
        if self.proc is not None and self.poll() is None:
            self.signalled = True
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def request_stop(self) -> None:
        """SIGTERM to the trainer's driver only: it finishes its step, saves a checkpoint and exits.

        Not to the process group: that would take down the Ray workers the driver needs to write the checkpoint.
        """
        if self.proc is not None and self.poll() is None:
            self.signalled = True
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        if self.proc is not None and self.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    @property
    def seconds(self) -> float:
        return round((self.ended or time.time()) - self.started, 1) if self.started else 0.0


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def latest_checkpoint(output_dir: Path) -> Path | None:
    from verl_omni.trainer import checkpointing

    step = checkpointing.latest_step(output_dir)
    return None if step is None else checkpointing.step_dir(output_dir, step)


def best_validated_step(success_rates: dict[int, float]) -> int:
    """The checkpoint step with the highest closed-loop validation SR; a tie goes to the later step (more training
    for the same validated success).

    Args:
        success_rates: Step -> SR on the validation episodes (at least one entry).

    Raises:
        ValueError: ``success_rates`` is empty.
    """
    if not success_rates:
        raise ValueError("best_validated_step: no validated checkpoint to choose from")
    return max(success_rates, key=lambda step: (success_rates[step], step))


def validation_success_rate(report: Path) -> float:
    """SR of one ``closed_loop_eval.py`` report (its checkpoint run)."""
    episodes = json.loads(report.read_text())["runs"]["checkpoint"]["episodes"]
    return sum(bool(e["success"]) for e in episodes) / len(episodes)


def metrics_steps(output_dir: Path) -> int:
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip())


class StudyRunner:
    """Schedules training, export and evaluation jobs of the study.

    Args:
        results: ``W/results`` (created; must not exist yet).
        runs: ``[(run_name, trainer_config_dict)]``.
        ckpt: Stage-II checkpoint (the base of every export and the "before" of every comparison).
        scenes: Held-out evaluation scenes.
        eval_settings: Closed-loop settings.
        max_train: Trainings running at once.
        max_eval: Exports/evaluations running at once.
        train_deadline_s / deadline_s: Wall-clock guards (seconds from start).
        threads_per_job: ``OMP_NUM_THREADS`` of every job.
        meta: Written to ``results/study.json`` (settings, workspace description, command line).
        resume: Go on with an earlier invocation's ``results`` (e.g. on a machine that gives 10-minute calls):
            finished runs are kept, a run whose last checkpoint is its final step is exported and evaluated, the
            other trainings resume from their last checkpoint (``trainer.resume=auto``); evaluations cut off
            are moved aside and run again.
        val_settings: Closed-loop validation during training (None: off): every checkpoint a training saves is
            exported and evaluated with these settings (another seed than the held-out one) while the training
            goes on; the runs keep all their checkpoints for it. Reports land in ``evals/val/<run>/step_<N>``
            and the run's status lists them under ``validation``.
        select_by_validation: Export and evaluate the checkpoint of each run with the best validation SR
            (``best_validated_step``) instead of its last one, once every checkpoint it saved is validated; its status
            records ``selected_step``. Model selection on the validation seed, never on the held-out one.
        stop_grace_s: After the training guard asks a trainer to stop (it finishes its step and saves it), the
            seconds it is given before its process group is killed; give it more than a step and a save take.
    """

    def __init__(
        self,
        results: Path,
        runs: list[tuple[str, dict]],
        ckpt: Path,
        scenes: Path,
        eval_settings: EvalSettings,
        max_train: int,
        max_eval: int,
        train_deadline_s: float,
        deadline_s: float,
        threads_per_job: int = 2,
        meta: dict | None = None,
        resume: bool = False,
        val_settings: EvalSettings | None = None,
        select_by_validation: bool = False,
        stop_grace_s: float = 120.0,
    ) -> None:
        self.results = results
        self.ckpt = ckpt
        self.scenes = scenes
        self.eval_settings = eval_settings
        self.max_train, self.max_eval = max_train, max_eval
        self.train_deadline_s, self.deadline_s = train_deadline_s, deadline_s
        self.stop_grace_s = float(stop_grace_s)
        self.threads = str(threads_per_job)
        self.configs = dict(runs)
        self.state: dict[str, dict] = {name: {"state": "pending"} for name, _ in runs}
        self.state[STAGE2] = {"state": "pending", "kind": "baseline"}
        self.jobs: dict[str, Job] = {}
        self.t0 = 0.0
        self.meta = meta or {}
        self.resume = resume
        self.val_settings = val_settings
        if select_by_validation and val_settings is None:
            raise ValueError("select_by_validation needs val_settings (closed-loop validation during training)")
        self.select_by_validation = select_by_validation
        self.val_jobs: dict[str, Job] = {}  # "<run>@<step>" -> its export, then its evaluation
        if val_settings is not None:
            for cfg in self.configs.values():
                cfg["trainer"]["max_checkpoints_to_keep"] = 0  # a checkpoint must outlive its validation

    # ------------------------------------------------------------------------------------------ status
    def _write_status(self) -> None:
        status = {
            "format": "wnm-stage3-study-status/1",
            "elapsed_s": round(time.time() - self.t0, 1),
            "train_deadline_s": self.train_deadline_s,
            "deadline_s": self.deadline_s,
            "eval": vars(self.eval_settings),
            "runs": self.state,
        }
        tmp = self.results / f".status.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(status, indent=1, sort_keys=True) + "\n")
        tmp.replace(self.results / "status.json")  # our own status file, rewritten on purpose

    def _set(self, name: str, **fields) -> None:
        self.state[name].update(fields)
        print(f"[study {time.time() - self.t0:6.1f}s] {name}: {fields}", flush=True)
        self._write_status()

    # ------------------------------------------------------------------------------------------ jobs
    def _python(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def _start_training(self, name: str) -> None:
        import yaml

        run_dir = self.results / "runs" / name
        cfg_dir = run_dir / "config"
        cfg_dir.mkdir(parents=True, exist_ok=self.resume)
        (cfg_dir / "run.yaml").write_text(yaml.safe_dump(self.configs[name], sort_keys=False))
        # Ray's socket paths must stay below 107 bytes: a short temp dir per run, outside the results.
        ray_tmp = Path("/tmp") / f"wst_{os.getpid()}_{len(self.jobs)}"
        job = Job(
            f"train:{name}",
            self._python("-m", "verl_omni.trainer.main_stage3", "--config-path", str(cfg_dir), "--config-name", "run"),
            run_dir / "train.log",
            env={
                "WAM_RAY_TMPDIR": str(ray_tmp),
                "WAM_RAY_NAMESPACE": f"study_{name}",
                "OMP_NUM_THREADS": self.threads,
                # The trainings run side by side, each with its own Ray runtime: cap each object store (a
                # step's batch is a few MB) instead of Ray's default 30% of the host's memory per runtime.
                "WAM_RAY_OBJECT_STORE_GB": os.environ.get("WAM_RAY_OBJECT_STORE_GB", "4"),
            },
        )
        job.start()
        self.jobs[name] = job
        self._set(name, state="training", output_dir=str(run_dir / "out"), log=str(job.log))

    def _start_export(self, name: str, step_dir: Path) -> None:
        export = self.results / "runs" / name / "export"
        job = Job(
            f"export:{name}",
            self._python(
                "tools/checkpoint/export_wnm_checkpoint.py",
                "--base-vln",
                str(self.ckpt),
                "--actor-checkpoint",
                str(step_dir),
                "--output-dir",
                str(export),
                "--no-progress",
            ),
            self.results / "runs" / name / "export.log",
            env={"OMP_NUM_THREADS": self.threads},
        )
        job.start()
        self.jobs[name] = job
        self._set(name, state="exporting", checkpoint=str(step_dir), export=str(export))

    def _start_eval(self, name: str, ckpt: Path) -> None:
        out = self.results / "evals" / name
        if out.exists():  # left by an evaluation that was cut off (resume): kept aside, never deleted
            out.rename(out.with_name(f"{name}.cut-off-{int(time.time())}"))
        job = Job(
            f"eval:{name}",
            self._python(
                "tools/eval/closed_loop_eval.py",
                "--checkpoint",
                str(ckpt),
                *self.eval_settings.argv(self.scenes),
                "--output-dir",
                str(out),
            ),
            self.results / "evals" / f"{name}.log",
            env={"OMP_NUM_THREADS": self.threads},
        )
        job.start()
        self.jobs[name] = job
        self._set(name, state="evaluating", eval_dir=str(out))

    # ------------------------------------------------------------------------------------------ validation
    def _busy(self) -> int:
        """Export and evaluation jobs running, held-out and validation ones together (they share ``max_eval``)."""
        active = sum(1 for j in self.val_jobs.values() if j.poll() is None)
        return self._count("exporting") + self._count("evaluating") + active

    def _validate(self, name: str) -> None:
        """Advances the closed-loop validation of run ``name``: finishes jobs, starts the next checkpoint's."""
        from verl_omni.utils.run_layout import checkpoint_steps, is_complete, step_dir

        st = self.state[name]
        val = st.setdefault("validation", {})
        for key, job in list(self.val_jobs.items()):
            run, step = key.rsplit("@", 1)
            if run != name or job.poll() is None:
                continue
            del self.val_jobs[key]
            entry = val[step]
            if job.returncode != 0:
                entry.update(state="failed", reason=f"{job.name} exit {job.returncode}", log_tail=log_tail(job.log))
            elif entry["state"] == "exporting":
                out = self.results / "evals" / "val" / name / f"step_{step}"
                if out.exists():  # cut off earlier (resume): kept aside, never deleted
                    out.rename(out.with_name(f"step_{step}.cut-off-{int(time.time())}"))
                argv = self._python("tools/eval/closed_loop_eval.py", "--checkpoint", entry["export"],
                                    *self.val_settings.argv(self.scenes), "--output-dir", str(out))  # fmt: skip
                self.val_jobs[key] = Job(f"val-eval:{name}@{step}", argv, out.parent / f"step_{step}.log",
                                         env={"OMP_NUM_THREADS": self.threads})  # fmt: skip
                self.val_jobs[key].start()
                entry.update(state="evaluating", eval_dir=str(out))
            else:
                entry.update(state="done", report=str(Path(entry["eval_dir"]) / "report.json"), eval_s=job.seconds)
            self._set(name, validation=val)
        out = Path(st.get("output_dir", ""))
        if not out.is_dir() or self._busy() >= self.max_eval:
            return
        todo = [n for n in sorted(checkpoint_steps(out)) if str(n) not in val and is_complete(step_dir(out, n))]
        if not todo:
            return
        step = str(todo[0])
        export = self.results / "runs" / name / "val" / f"step_{step}" / "export"
        if export.exists():  # cut off earlier (resume): kept aside, never deleted
            export.rename(export.with_name(f"export.cut-off-{int(time.time())}"))
        argv = self._python("tools/checkpoint/export_wnm_checkpoint.py", "--base-vln", str(self.ckpt),
                            "--actor-checkpoint", str(step_dir(out, int(step))), "--output-dir", str(export),
                            "--no-progress")  # fmt: skip
        key = f"{name}@{step}"
        self.val_jobs[key] = Job(f"val-export:{key}", argv, export.parent / "export.log",
                                 env={"OMP_NUM_THREADS": self.threads})  # fmt: skip
        self.val_jobs[key].start()
        val[step] = {"state": "exporting", "export": str(export)}
        self._set(name, validation=val)

    def _validate_start(self) -> None:
        """Validation of the start itself: the Stage-II checkpoint on the validation episodes, recorded as its
        step 0, so every run's validation rows have a baseline on the same episodes."""
        val = self.state[STAGE2].setdefault("validation", {})
        key = f"{STAGE2}@0"
        job = self.val_jobs.get(key)
        if job is not None:
            if job.poll() is None:
                return
            del self.val_jobs[key]
            if job.returncode != 0:
                val["0"].update(state="failed", reason=f"{job.name} exit {job.returncode}", log_tail=log_tail(job.log))
            else:
                val["0"].update(
                    state="done", report=str(Path(val["0"]["eval_dir"]) / "report.json"), eval_s=job.seconds
                )
            self._set(STAGE2, validation=val)
            return
        if "0" in val or self._busy() >= self.max_eval:
            return
        out = self.results / "evals" / "val" / STAGE2 / "step_0"
        if out.exists():  # cut off earlier (resume): kept aside, never deleted
            out.rename(out.with_name(f"step_0.cut-off-{int(time.time())}"))
        argv = self._python("tools/eval/closed_loop_eval.py", "--checkpoint", str(self.ckpt),
                            *self.val_settings.argv(self.scenes), "--output-dir", str(out))  # fmt: skip
        self.val_jobs[key] = Job(
            f"val-eval:{key}", argv, out.parent / "step_0.log", env={"OMP_NUM_THREADS": self.threads}
        )
        self.val_jobs[key].start()
        val["0"] = {"state": "evaluating", "eval_dir": str(out)}
        self._set(STAGE2, validation=val)

    def _validation_pending(self) -> bool:
        if self.val_settings is None:
            return False
        if self.val_jobs or "0" not in self.state[STAGE2].get("validation", {}):
            return True
        from verl_omni.utils.run_layout import checkpoint_steps

        for name in self.configs:
            st = self.state[name]
            out = Path(st.get("output_dir", ""))
            if st["state"] == "failed" or not out.is_dir():
                continue
            if any(str(n) not in st.get("validation", {}) for n in checkpoint_steps(out)):
                return True
        return False

    # ------------------------------------------------------------------------------------------ loop
    def _count(self, state: str) -> int:
        return sum(s["state"] == state for s in self.state.values())

    def _advance(self, name: str, now: float) -> None:
        st = self.state[name]
        job = self.jobs.get(name)
        if st["state"] == "training":
            if now - self.t0 > self.train_deadline_s and job.poll() is None:
                if not job.signalled:
                    # Once: a second SIGTERM would stop the trainer without its checkpoint.
                    self._set(name, note=f"training stopped at the {self.train_deadline_s:.0f}s guard")
                    job.request_stop()
                elif now - self.t0 > self.train_deadline_s + self.stop_grace_s:
                    # The step in progress and its checkpoint did not finish in time: the newest periodic one is used.
                    job.kill()
            rc = job.poll()
            if rc is None:
                return
            shutil.rmtree(job.env["WAM_RAY_TMPDIR"], ignore_errors=True)  # this run's own Ray session files
            out = Path(st["output_dir"])
            steps = metrics_steps(out)
            ckpt = latest_checkpoint(out)
            self._set(name, train_rc=rc, train_s=job.seconds, steps_done=steps)
            if ckpt is None:
                self._set(name, state="failed", reason=f"training exit {rc}, no checkpoint", log_tail=log_tail(job.log))
            elif self._busy() < self.max_eval and not self.select_by_validation:
                self._start_export(name, ckpt)
            else:
                self._set(name, state="trained")
        elif st["state"] == "trained":
            if self._busy() < self.max_eval:
                ckpt = self._final_checkpoint(name)
                if ckpt is not None:
                    self._start_export(name, ckpt)
        elif st["state"] == "exported":
            if self._busy() < self.max_eval:
                self._start_eval(name, Path(st["export"]))
        elif st["state"] == "exporting":
            rc = job.poll()
            if rc is None:
                return
            if rc != 0:
                self._set(name, state="failed", reason=f"export exit {rc}", log_tail=log_tail(job.log))
            else:
                self._start_eval(name, Path(st["export"]))
        elif st["state"] == "evaluating":
            rc = job.poll()
            if rc is None:
                return
            if rc != 0:
                self._set(name, state="failed", reason=f"eval exit {rc}", log_tail=log_tail(job.log))
            else:
                self._set(name, state="done", eval_s=job.seconds, report=str(Path(st["eval_dir"]) / "report.json"))
        elif st["state"] == "pending":
            if name == STAGE2:
                if self._busy() < self.max_eval:
                    self._start_eval(name, self.ckpt)
            elif now - self.t0 >= self.train_deadline_s:
                self._set(name, state="failed", reason=f"not started before the {self.train_deadline_s:.0f}s guard")
            elif self._count("training") < self.max_train:
                self._start_training(name)

    def _final_checkpoint(self, name: str) -> Path | None:
        """The checkpoint a finished training exports: its last one, or with ``select_by_validation`` the best
        validated one (None while a checkpoint still awaits its validation)."""
        from verl_omni.utils.run_layout import checkpoint_steps, is_complete, step_dir

        out = Path(self.state[name]["output_dir"])
        if not self.select_by_validation:
            return Path(latest_checkpoint(out))
        val = self.state[name].get("validation", {})
        steps = [n for n in sorted(checkpoint_steps(out)) if is_complete(step_dir(out, n))]
        if any(val.get(str(n), {}).get("state") not in ("done", "failed") for n in steps):
            return None
        rates = {
            n: validation_success_rate(Path(val[str(n)]["report"])) for n in steps if val[str(n)]["state"] == "done"
        }
        if not rates:
            self._set(name, selection="no checkpoint was validated: the last one")
            return Path(latest_checkpoint(out))
        best = best_validated_step(rates)
        self._set(name, selected_step=best, selection=f"best validation SR {rates[best]:.3f} of steps {sorted(rates)}")
        return step_dir(out, best)

    def _take_over(self) -> None:
        """Resume: the state of each run from the earlier invocation's ``status.json`` and its files."""
        status = self.results / "status.json"
        if not status.is_file():
            raise FileNotFoundError(f"{status}: not found; nothing to resume (run without --resume first)")
        before = json.loads(status.read_text())["runs"]
        for name in list(self.state):
            prev = dict(before.get(name, {}))
            # Validations cut off with the earlier invocation run again; finished ones are kept.
            prev["validation"] = {k: v for k, v in prev.get("validation", {}).items() if v.get("state") == "done"}
            if prev.get("state") == "done":
                self.state[name] = prev
                continue
            self.state[name]["validation"] = prev["validation"]
            export = self.results / "runs" / name / "export"
            if name != STAGE2 and (export / "checkpoint_manifest.json").is_file():
                self.state[name] = {**prev, "state": "exported", "export": str(export)}
                continue
            if name == STAGE2:
                continue
            out = self.results / "runs" / name / "out"
            self.configs[name]["trainer"]["resume"] = "auto"
            ckpt = latest_checkpoint(out) if out.is_dir() else None
            total = self.configs[name]["trainer"]["total_steps"]
            if ckpt is not None and ckpt.name == f"global_step_{total}":
                self.state[name] = {**prev, "state": "trained", "output_dir": str(out)}
        print(f"[study] resuming {self.results}: { ({n: s['state'] for n, s in self.state.items()}) }", flush=True)

    def run(self) -> dict:
        """Runs everything; returns the final status per run. Never raises for a failing run."""
        if self.resume:
            self._take_over()
        else:
            self.results.mkdir(parents=True)
            (self.results / "study.json").write_text(json.dumps(self.meta, indent=1, default=list) + "\n")
        self.t0 = time.time()
        self._write_status()
        active = ("pending", "training", "trained", "exported", "exporting", "evaluating")
        try:
            while any(s["state"] in active for s in self.state.values()) or self._validation_pending():
                now = time.time()
                if now - self.t0 > self.deadline_s:
                    for name, s in self.state.items():
                        if s["state"] in active:
                            if name in self.jobs:
                                self.jobs[name].terminate()
                            self._set(name, state="failed", reason=f"{s['state']} at the {self.deadline_s:.0f}s guard")
                    for key in list(self.val_jobs):  # recorded as cut off; --resume runs them again
                        run, step = key.rsplit("@", 1)
                        self.state[run]["validation"][step].update(state="failed", reason="deadline guard")
                    self._write_status()
                    break
                # Stage-II evaluation first (it needs no training), then runs in plan order.
                for name in [STAGE2, *self.configs]:
                    try:
                        self._advance(name, now)
                    except Exception as e:  # one run's problem (a file, a spawn) must not end the others
                        if name in self.jobs:
                            self.jobs[name].terminate()
                        self._set(name, state="failed", reason=f"{type(e).__name__}: {e}")
                    if self.val_settings is not None:
                        try:
                            self._validate_start() if name == STAGE2 else self._validate(name)
                        except Exception as e:  # validation must not end the run it watches
                            print(f"[study] {name}: closed-loop validation: {type(e).__name__}: {e}", flush=True)
                time.sleep(1.0)
        finally:
            jobs = [*self.jobs.values(), *self.val_jobs.values()]
            for job in jobs:
                job.terminate()
            time.sleep(2.0)
            for job in jobs:
                job.kill()
            self._write_status()
        return self.state
