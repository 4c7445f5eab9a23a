"""What the driver sends the reward workers (``RewardBatch.select`` shards) and merges back (``RewardScores``)."""

import numpy as np
import pytest
from reward_helpers import make_batch

from verl_omni.utils.reward_score import RewardScores


def test_select_cuts_every_per_rollout_field_and_keeps_absent_ones_absent():
    actions = np.zeros((3, 32, 4))
    actions[:, 0, 0] = [0.1, 0.2, 0.3]
    latents = np.arange(3.0).reshape(3, 1)
    batch = make_batch(
        actions,
        start=(0.0, 0.0, 0.0),
        goal=(1.0, 1.0),
        ids=["r0", "r1", "r2"],
        scene_id=["s0", "s1", "s2"],
        generated_latents=latents,
        target_latents=latents + 10,
    )
    part = batch.select(slice(1, 3))
    assert part.size == 2 and part.rollout_id == ["r1", "r2"] and part.scene_id == ["s1", "s2"]
    assert part.actions[:, 0, 0].tolist() == [0.2, 0.3]
    assert part.generated_latents.flatten().tolist() == [1.0, 2.0]
    assert part.target_latents.flatten().tolist() == [11.0, 12.0]
    assert part.generated_frames is None and part.target_frames is None
    empty = batch.select(slice(3, 3))
    assert empty.size == 0 and empty.rollout_id == []


def _scores(n: int, first: float, score_s: float, **diagnostics) -> RewardScores:
    m = np.arange(first, first + 9 * n, dtype=np.float32).reshape(n, 9)
    return RewardScores(m, {k: np.asarray(v) for k, v in diagnostics.items()}, [f"w{first:g}"] * n, score_s)


def test_concat_keeps_shard_order_the_slowest_time_and_only_diagnostics_every_nonempty_shard_has():
    a = _scores(2, 0.0, 0.5, **{"nav/progress": [1.0, 2.0], "stop/early": [0.0, 1.0]})
    b = _scores(1, 100.0, 1.5, **{"nav/progress": [3.0]})  # lacks stop/early
    out = RewardScores.concat([a, b, RewardScores.empty()])  # a worker with no rollouts answers empty()
    assert len(out) == 3 and out.scores[:, 0].tolist() == [0.0, 9.0, 100.0]
    assert list(out.diagnostics) == ["nav/progress"] and out.diagnostics["nav/progress"].tolist() == [1.0, 2.0, 3.0]
    assert out.warnings == ["w0", "w0", "w100"] and out.score_s == 1.5
    with pytest.raises(ValueError, match=r"RewardScores.scores must be \[N, 9\], got \[2, 4\]"):
        RewardScores(np.zeros((2, 4), np.float32))
