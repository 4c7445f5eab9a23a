"""Open-loop probes: does a WNM policy use what it sees and is told?

On held-out expert query states the policy samples its 32 actions with the deterministic ODE sampler; the
actions are integrated from the origin and compared with the expert's continuation: the endpoint error after
one chunk (8 steps) and after all 32 steps (metres), the heading error after one chunk (degrees), and how
often the policy's STOP falls inside the first chunk where the expert's does not (early) and the reverse
(missed): an early STOP ends a closed-loop episode for good, the measured failure of Stage-II checkpoints. The
same numbers for the *mean expert action sequence* of the training data are the baseline a policy that
ignores its inputs would reach. Each ablation breaks one input while keeping the rest:

- ``shuffled_instruction``: every state gets another state's instruction (goal named wrongly);
- ``static_history``: the 33 history frames are all the current frame (no motion history);
- ``shuffled_views``: every state gets another state's frames with its own instruction.

A policy that conditions on an input gets worse when it is broken; one that does not stays the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from verl_omni.data.actions import first_stop_index, integrate_actions, wrap_angle

ABLATIONS: tuple[str, ...] = ("full", "shuffled_instruction", "static_history", "shuffled_views")


def open_loop_errors(actions: np.ndarray, expert_actions: np.ndarray, chunk: int = 8) -> dict[str, np.ndarray]:
    """Per-state errors of action sequences against the expert's.

    Args:
        actions: ``[N, S, 4]`` decoded actions (metres, radians, stop flag).
        expert_actions: ``[N, S, 4]`` the expert's.
        chunk: Steps of the first chunk.

    Returns:
        ``endpoint_chunk_m``, ``endpoint_all_m``, ``heading_chunk_deg``, ``early_stop_chunk`` (1 where the policy
        stops within the first ``chunk`` steps and the expert does not, else 0) and ``missed_stop_chunk`` (the
        reverse), each ``[N]``. Both sequences honour the first-STOP rule (poses freeze at STOP), like execution.
    """
    actions = np.asarray(actions, np.float64)
    origin = np.zeros((len(actions), 3))
    p = integrate_actions(origin, actions)
    q = integrate_actions(origin, np.asarray(expert_actions, np.float64))
    stops_here = first_stop_index(actions[..., 3] > 0.5) < chunk
    expert_stops_here = first_stop_index(np.asarray(expert_actions)[..., 3] > 0.5) < chunk
    return {
        "early_stop_chunk": (stops_here & ~expert_stops_here).astype(np.float64),
        "missed_stop_chunk": (~stops_here & expert_stops_here).astype(np.float64),
        "endpoint_chunk_m": np.linalg.norm(p[:, chunk, :2] - q[:, chunk, :2], axis=-1),
        "endpoint_all_m": np.linalg.norm(p[:, -1, :2] - q[:, -1, :2], axis=-1),
        "heading_chunk_deg": np.degrees(np.abs(wrap_angle(p[:, chunk, 2] - q[:, chunk, 2]))),
    }


def summarize(errors: dict[str, np.ndarray]) -> dict[str, float]:
    """Means of :func:`open_loop_errors` (plain floats)."""
    return {k: float(np.mean(v)) for k, v in errors.items()}


def _ablate(name: str, histories: np.ndarray, instructions: list[str]) -> tuple[np.ndarray, list[str]]:
    n = len(instructions)
    shift = np.roll(np.arange(n), 1)  # a fixed derangement: every state gets its neighbour's input
    if name == "full":
        return histories, instructions
    if name == "shuffled_instruction":
        return histories, [instructions[i] for i in shift]
    if name == "static_history":
        return np.repeat(histories[:, -1:], histories.shape[1], axis=1), instructions
    if name == "shuffled_views":
        return histories[shift], instructions
    raise ValueError(f"unknown ablation {name!r}; choose from {ABLATIONS}")


def probe_policy(
    policy, examples: Sequence, mean_actions: np.ndarray, batch: int = 64, ablations: Sequence[str] = ABLATIONS
) -> dict[str, dict[str, float]]:
    """Open-loop errors of ``policy`` on expert examples, with the mean-action baseline and the ablations.

    Args:
        policy: A :class:`~verl_omni.sim.wnm_policy.WNMPolicy` (``act(history, queries)``).
        examples: ``ExpertExample``-like items (``history [33, H, W, 3]``, ``actions [32, 4]``, ``instructions``).
        mean_actions: ``[32, 4]`` the training data's mean expert action sequence (the constant baseline).
        batch: States per policy call.
        ablations: Which input ablations to run (``full`` = none).

    Returns:
        ``{"mean_action_baseline": {...}, <ablation>: {...}}`` of mean errors.
    """
    from verl_omni.sim.closed_loop import PolicyQuery

    if len(examples) < 2:
        raise ValueError("probe_policy: needs at least 2 examples (the ablations swap inputs between states)")
    expert = np.stack([e.actions for e in examples])
    histories = np.stack([e.history for e in examples])
    instructions = [e.instructions[0] for e in examples]
    out = {"mean_action_baseline": summarize(open_loop_errors(np.repeat(mean_actions[None], len(examples), 0), expert))}
    for name in ablations:
        hist, instr = _ablate(name, histories, instructions)
        acts = []
        for i in range(0, len(examples), batch):
            queries = [
                PolicyQuery(f"probe{j}", seed=j, call_index=0, instruction=instr[j], pose=np.zeros(3), goal=np.zeros(2))
                for j in range(i, min(i + batch, len(examples)))
            ]
            acts.append(np.asarray(policy.act(hist[i : i + batch], queries), np.float64))
        out[name] = summarize(open_loop_errors(np.concatenate(acts), expert))
    return out


def format_probe_table(results: dict[str, dict[str, float]]) -> str:
    """A markdown table of :func:`probe_policy` results."""
    lines = [
        "| input | endpoint error, 8 steps (m) | endpoint error, 32 steps (m) | heading error, 8 steps (deg) | "
        "early STOP, 8 steps | missed STOP, 8 steps |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['endpoint_chunk_m']:.3f} | {r['endpoint_all_m']:.3f} | {r['heading_chunk_deg']:.1f} | "
            f"{r.get('early_stop_chunk', math.nan):.3f} | {r.get('missed_stop_chunk', math.nan):.3f} |"
            if all(math.isfinite(v) for v in r.values())
            else f"| {name} | - | - | - | - | - |"
        )
    return "\n".join(lines)
