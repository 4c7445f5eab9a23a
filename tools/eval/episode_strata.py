#!/usr/bin/env python3
"""Success rates split by what each evaluation episode demands: goal object in the start room, in view at the
start, in view after a turn in place.

The episodes are drawn again from the same settings as the evaluation that produced the reports (held-out
scenes synthesized from ``--seed``, ``--episodes`` round-robin, the level's task sampler and ``--goal-point``),
exactly as ``closed_loop_eval.py --synthesize`` and ``scripts/train_stage2.py`` draw them, and matched to the
reports' per-episode records by episode id. Reports are ``closed_loop_eval.py`` ``report.json`` files (every
run in them) or the per-checkpoint files of ``train_stage2.py`` (``<workdir>/eval/<name>.json``).

Example:

    python tools/eval/episode_strata.py --level two_rooms --goal-point nearest --synthesize 40 --seed 2000 \\
      --episodes 400 W/eval/stage2_r1.json W/eval/stage2_r1_gate.json eval_baselines/report.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from verl_omni.sim.label_args import add_goal_point_argument  # noqa: E402


class CliError(Exception):
    """A user error; the message says what to change."""


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("reports", nargs="+", type=Path, help="evaluation reports with per-episode records")
    p.add_argument("--level", required=True, help="task level the episodes were drawn for (one_room, two_rooms, house)")
    add_goal_point_argument(p)
    p.add_argument("--synthesize", type=int, required=True, help="held-out scenes the evaluation synthesized")
    p.add_argument("--seed", type=int, required=True, help="the evaluation seed")
    p.add_argument("--episodes", type=int, required=True, help="episodes the evaluation drew")
    p.add_argument("--metric", default="success", help="boolean per-episode field to rate (default success)")
    p.add_argument("--output", type=Path, help="also write the rates as JSON here (refuses to overwrite)")
    return p.parse_args(argv)


def _runs(path: Path) -> tuple[dict[str, list[dict]], list[dict] | None]:
    """Label -> per-episode records of one report file, and the episode specs it carries (None if it has none)."""
    from verl_omni.sim.eval_metrics import report_runs

    try:
        return report_runs(path)
    except ValueError as e:
        raise CliError(str(e)) from e


def _check_specs(path: Path, carried: list[dict] | None, drawn: dict) -> bool:
    """Whether the report's own specs are the episodes drawn here (same start and goal); False if it has none.

    Raises:
        CliError: a carried spec differs from the one drawn under the same id.
    """
    if not carried:
        return False
    for spec in carried:
        mine = drawn.get(spec.get("episode_id"))
        same = mine is not None and all(
            abs(float(a) - float(b)) < 1e-6
            for a, b in zip([*spec["start_pose"], *spec["goal"]], [*mine.start_pose, *mine.goal], strict=True)
        )
        if not same:
            raise CliError(
                f"{path}: episode {spec.get('episode_id')} has another start or goal than the one drawn here; pass "
                "the --level, --goal-point, --synthesize, --seed and --episodes of that evaluation"
            )
    return True


def _format(rate: dict) -> str:
    if rate["mean"] is None:
        return "- (0)"
    return f"{rate['mean']:.3f} [{rate['low']:.3f}, {rate['high']:.3f}] ({rate['episodes']})"


def main(argv=None) -> int:
    args = _parse(argv)
    try:
        if args.output is not None and args.output.exists():
            raise CliError(f"--output {args.output} exists; choose a new name")
        runs: dict[str, list[dict]] = {}
        carried: dict[Path, list[dict] | None] = {}
        for path in args.reports:
            found, carried[path] = _runs(path)
            for label, eps in found.items():
                runs[label if label not in runs else f"{label} ({path})"] = eps
        for label, eps in runs.items():
            bad = next((e for e in eps if not isinstance(e.get(args.metric), bool)), None)
            if bad is not None:
                from verl_omni.sim.eval_metrics import PROPORTION_METRICS

                raise CliError(
                    f"{label}: episode {bad.get('episode_id')} has no boolean field {args.metric!r}; pick --metric "
                    f"among {', '.join(PROPORTION_METRICS)}"
                )

        from verl_omni.sim.collector import CollectorConfig, SceneError
        from verl_omni.sim.episode_strata import STRATA, episode_strata, stratified_rates
        from verl_omni.sim.heldout import draw_heldout_episodes
        from verl_omni.sim.levels import get_level

        try:
            level = get_level(args.level)
        except (KeyError, ValueError) as e:
            raise CliError(f"--level {args.level}: {e}") from e
        task = CollectorConfig(min_goal_distance_m=level.min_goal_distance_m, goal_point=args.goal_point)
        try:
            plans, specs = draw_heldout_episodes(args.synthesize, args.episodes, args.seed, level.floorplan(), task)
        except (SceneError, ValueError) as e:
            raise CliError(f"cannot draw the episodes again: {e}") from e
        drawn = {s.episode_id: s for s in specs}
        for path, own in carried.items():
            if not _check_specs(path, own, drawn):
                print(f"note: {path} carries no episode specs; matched by episode id only", file=sys.stderr)
        by_scene = {p.scene_id: p for p in plans}
        try:
            strata = {s.episode_id: episode_strata(by_scene[s.scene_id], s) for s in specs}
        except ValueError as e:
            raise CliError(str(e)) from e
        for label, eps in runs.items():
            missing = [e["episode_id"] for e in eps if e["episode_id"] not in strata]
            if missing:
                raise CliError(
                    f"{label}: episode {missing[0]} is not among the {len(specs)} episodes drawn here; pass the "
                    "--level, --goal-point, --synthesize, --seed and --episodes of that evaluation"
                )
        rates = {label: stratified_rates(eps, strata, args.metric) for label, eps in runs.items()}
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    share = {name: sum(s[name] for s in strata.values()) / len(strata) for name in STRATA}
    print(f"{len(specs)} episodes on `{args.level}` (goal point {args.goal_point}, seed {args.seed}); {args.metric} "
          "by stratum, 95% Wilson intervals (episodes)\n")  # fmt: skip
    print("| stratum (share of episodes) | " + " | ".join(f"{lab}: yes | {lab}: no" for lab in rates) + " |")
    print("| --- |" + " --- | --- |" * len(rates))
    for name in STRATA:
        cells = [f"{_format(r[name]['yes'])} | {_format(r[name]['no'])}" for r in rates.values()]
        print(f"| {name} ({share[name]:.0%}) | " + " | ".join(cells) + " |")
    if args.output is not None:
        payload = {"arguments": {k: str(v) for k, v in vars(args).items()}, "share": share, "rates": rates}
        from verl_omni.utils.run_layout import atomic_write_text

        atomic_write_text(args.output, json.dumps(payload, indent=1))
        print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
