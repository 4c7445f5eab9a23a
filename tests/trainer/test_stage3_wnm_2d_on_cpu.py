"""A WNM-2D checkpoint trains through the same entry point as WNM-3D: one Stage-III step through Ray on CPU.

The workspace is built by the real user commands with a ``wnm_2d`` tiny checkpoint (synthesize -> checkpoint ->
convert -> sample -> event val); ``python -m verl_omni.trainer.main_stage3`` then runs one step with
``model.variant: wnm_2d`` on 2 actor ranks (gloo, FSDP2) and 1 reward worker. Both ranks build their model,
backend and actor through :mod:`verl_omni.pipelines.wnm_2d`.
"""

from __future__ import annotations

import json

import pytest
import torch
from stage3_e2e_helpers import SMALLEST_PLAN, build_workspace, run_cli, write_trainer_config

# One prompt (16 rollouts over 2 ranks), 3 denoising steps, a window of one SDE step, no validation or media.
ONE_STEP = {**SMALLEST_PLAN, "model.variant": "wnm_2d", "trainer.total_steps": 1, "trainer.save_freq": 1}


@pytest.mark.timeout(900)
def test_one_stage3_step_of_a_wnm_2d_checkpoint(tmp_path):
    ws = build_workspace(tmp_path / "ws", scenes=2, episodes=2, seed=0, train_size=2, variant="wnm_2d")
    assert json.loads((ws["ckpt"] / "config.json").read_text())["model_config"]["variant"] == "wnm_2d"
    cfg_dir, out = tmp_path / "cfg", tmp_path / "out"
    write_trainer_config(cfg_dir / "run.yaml", ws, out, **ONE_STEP)
    proc = run_cli(
        ["-m", "verl_omni.trainer.main_stage3", "--config-path", str(cfg_dir), "--config-name", "run"], timeout=600
    )
    # Both ranks built the wnm_2d pipeline.
    assert proc.stdout.count("'variant': 'wnm_2d'") == 2, proc.stdout[-3000:]
    (line,) = (out / "metrics.jsonl").read_text().splitlines()
    m = json.loads(line)
    assert m["step"] == 1
    # Before the optimizer step the recomputed log-probs equal the rollout's bit for bit (fp32 on CPU, the same
    # module and the same rows per DiT call), so the first mini-batch's |logp - logp_old| is exactly 0.
    assert m["actor/logp_abs_diff_first_minibatch"] == 0.0
    # 1 prompt per step and 1 per mini-batch: one mini-batch, and the random policy's 16 rollouts differ in their
    # rewards, so it carries signal and is trained.
    assert m["advantages/skipped_minibatches"] == 0.0 and m["actor/skipped_nonfinite_updates"] == 0.0
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    import torch.distributed.checkpoint as dcp

    from verl_omni.models.wnm import load_wnm_checkpoint

    base = load_wnm_checkpoint(ws["ckpt"]).transformer.state_dict()
    trained = {k: torch.empty_like(v) for k, v in base.items()}
    dcp.load({"model": trained}, checkpoint_id=str(out / "global_step_1" / "actor"), no_dist=True)
    changed = [k for k in base if not torch.equal(base[k], trained[k])]
    assert len(changed) > len(base) // 2, f"only {len(changed)} of {len(base)} tensors of the wnm_2d DiT changed"
