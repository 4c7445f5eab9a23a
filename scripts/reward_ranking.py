"""Prints how the locked reward set ranks scripted behaviours on the query states of a GN0 collection.

The closed-loop evaluator prefers expert > noisy imitator > standing still > stopping at once; this prints the
mean reward per layer and of the summed layers of each (``verl_omni.utils.reward_score.ranking``), the evaluator's
metrics of the same windows (SR, OSR, SPL, premature STOP, collision, path length), and whether the summed reward
orders them the same way. Without ``--collection`` it synthesizes the study's collection
(8 scenes x 6 episodes, seed 11: 461 query states) into a temporary folder first (about 20 s on one core);
the image size does not change the poses, so 16 px keeps that cheap.

    python scripts/reward_ranking.py
    python scripts/reward_ranking.py --collection DIR --occupancy-root DIR [--config locked.yaml]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCKED = REPO / "recipes" / "wnm_3d" / "stage3" / "config" / "locked.yaml"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--collection", type=Path, help="GN0 collection folder (default: synthesize one)")
    p.add_argument("--occupancy-root", type=Path, help="its occupancy scenes (required with --collection)")
    p.add_argument("--config", type=Path, default=LOCKED, help="YAML holding reward.reward_set (default: locked)")
    p.add_argument("--num-scenes", type=int, default=8, help="scenes to synthesize (default 8)")
    p.add_argument("--episodes-per-scene", type=int, default=6, help="episodes per scene (default 6)")
    p.add_argument("--seed", type=int, default=11, help="collection seed (default 11, the study's)")
    p.add_argument("--heading-noise-rad", type=float, default=0.25, help="noisy imitator's dyaw noise std")
    p.add_argument("--noise-seed", type=int, default=0, help="seed of the imitator's noise (default 0)")
    p.add_argument(
        "--early-steps",
        type=int,
        default=2,
        help="the short STOP comes this many steps before the expert's (default 2; last table)",
    )
    return p


# The study's candidate arm cand_premature_base (scripts/study/plan.py): every premature STOP charged the
# missed-STOP penalty before its distance term. The last table is printed with and without it.
PREMATURE_BASE = {"premature_base": 1.0, "premature_cap": 3.0}


def synthesize(out: Path, args) -> tuple[Path, Path]:
    collection, occupancy = out / "collection", out / "occupancy"
    cmd = [sys.executable, str(REPO / "tools" / "data" / "synthesize_gn0_collection.py")]
    cmd += ["--output-dir", str(collection), "--occupancy-dir", str(occupancy), "--image-size", "16"]
    cmd += ["--num-scenes", str(args.num_scenes), "--episodes-per-scene", str(args.episodes_per_scene)]
    cmd += ["--seed", str(args.seed)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return collection, occupancy


def short_stop_table(reward_cfg: dict, states, args, steps: tuple[int, ...] = (2, 4, 6)) -> dict:
    """:func:`short_stop_preference` at each STOP step, with the navigation option ``charge_stop_chunk`` off and on."""
    from verl_omni.utils.reward_score import build_reward_set
    from verl_omni.utils.reward_score.ranking import short_stop_preference

    out: dict = {"steps": steps}
    for charge in (False, True):
        rewards = dict(reward_cfg["rewards"])
        rewards["navigation"] = dict(rewards["navigation"], charge_stop_chunk=charge)
        reward_set = build_reward_set({**reward_cfg, "rewards": rewards})
        rows = [short_stop_preference(reward_set, states, s, args.heading_noise_rad, args.noise_seed) for s in steps]
        out[charge] = [(r["fraction"], r["mean_gap"]) for r in rows]
        out["n"] = int(rows[0]["states"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.collection is None) != (args.occupancy_root is None):
        parser.error("--collection and --occupancy-root go together")
    if args.early_steps < 1:
        parser.error(f"--early-steps must be >= 1 (the short STOP comes that many steps before the expert's), got "
                     f"{args.early_steps}")  # fmt: skip
    if args.num_scenes < 1 or args.episodes_per_scene < 1:
        parser.error("--num-scenes and --episodes-per-scene must be >= 1")
    import yaml

    from verl_omni.utils.reward_score import build_reward_set
    from verl_omni.utils.reward_score.ranking import (
        POLICIES,
        format_metrics_table,
        format_order_by_distance,
        format_short_stop_against_missed,
        format_table,
        load_query_states,
        order_by_distance,
        rank_policies,
        short_stop_against_missed,
    )

    reward_cfg = dict(yaml.safe_load(args.config.read_text())["reward"]["reward_set"])
    with tempfile.TemporaryDirectory(prefix="reward_ranking-") as tmp:
        collection, occupancy = args.collection, args.occupancy_root
        if collection is None:
            collection, occupancy = synthesize(Path(tmp), args)
        reward_cfg["occupancy_root"] = str(occupancy)
        states = load_query_states(collection)
        table = rank_policies(build_reward_set(reward_cfg), states, POLICIES, args.heading_noise_rad, args.noise_seed)
        preference = short_stop_table(reward_cfg, states, args)
        by_distance = order_by_distance(build_reward_set(reward_cfg), states, args.heading_noise_rad, args.noise_seed)
        rewards = dict(reward_cfg["rewards"])
        rewards["stop"] = dict(rewards["stop"], **PREMATURE_BASE)
        short_vs_missed = {
            "as configured": short_stop_against_missed(build_reward_set(reward_cfg), states, args.early_steps),
            "with premature_base 1.0, cap 3.0": short_stop_against_missed(
                build_reward_set({**reward_cfg, "rewards": rewards}), states, args.early_steps
            ),
        }
    print(f"{states.size} query states; reward set from {args.config.name}; mean reward per rollout\n")
    print(format_table(table))
    print("\nThe evaluator's metrics of the same windows (verl_omni.sim.eval_metrics; the window ends at E):\n")
    print(format_metrics_table(table))
    print(
        "\nnav_1 (the layer crediting the first chunk's motion): share of states where the noisy imitator STOPping at"
    )
    print(
        f"step s scores above the same imitator driving on (states whose expert drives >= 12 steps; "
        f"n = {preference['n']})\n"
    )
    print("| charge_stop_chunk | " + " | ".join(f"STOP at {s}" for s in preference["steps"]) + " |")
    print("| --- |" + " --- |" * len(preference["steps"]))
    for charge in (False, True):
        cells = [f"{f:.0%} (gap {g:+.2f})" for f, g in preference[charge]]
        print(f"| {str(charge).lower()} | " + " | ".join(cells) + " |")
    print(
        "\nWhere STOP at once is premature (the expert drives >= 2 steps), by the query state's geodesic distance "
        "beyond the\nsuccess radius: mean summed reward, and the share of states where STOP at once scores above "
        "standing still\n(the evaluator: never; a STOP ends the episode in failure) and above the noisy imitator\n"
    )
    print(format_order_by_distance(by_distance))
    print(
        f"\nWhere the expert STOPs inside the window: the expert's path STOPped {args.early_steps} steps early "
        "(short) against\nthe expert's path with no STOP (no_stop), by the short STOP's geodesic distance beyond "
        "the radius: mean summed\nreward, and the share of states where short scores higher (the evaluator: "
        "never; short ends the episode\nin failure, a STOP not yet made can still come)"
    )
    for name, rows in short_vs_missed.items():
        print(f"\n{name}:\n")
        print(format_short_stop_against_missed(rows))
    totals = [table[p]["total"] for p in POLICIES]
    ordered = all(a > b for a, b in zip(totals, totals[1:]))
    print(f"\nsummed reward orders {' > '.join(POLICIES)}: {'yes' if ordered else 'NO'}")
    return 0 if ordered else 1


if __name__ == "__main__":
    sys.exit(main())
