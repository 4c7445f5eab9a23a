#!/usr/bin/env python
"""Can the WNM model learn to read its instruction at all? A text-only task, on CPU in a few minutes.

Every row has the same history and target clips; the expert action sequence depends only on the named object
(three objects, three constant turn rates, two instruction templates each). After ``--steps`` of the Stage-II
SFT recipe (``verl_omni.models.wnm.sft.train_sft``, text encoder trained), the action loss with each row's own
instruction is compared with the loss when the instruction of a row naming another object is given instead.
A working instruction path gives a large gap; a path that drops the text gives none. This separates "the model
cannot carry the instruction" from "the model does not ground it in the views" (the closed-loop failure).

    python scripts/probe_instruction_path.py --steps 120 [--pooled-text]
"""

from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120, help="SFT steps (default 120)")
    p.add_argument("--pooled-text", action="store_true", help="WNMConfig.pooled_text_modulation=True")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    import numpy as np
    import torch

    from verl_omni.models.wnm import WNMConfig, WNMModel, sft
    from verl_omni.models.wnm.encoded_rows import draw_noise
    from verl_omni.models.wnm.flow_matching import joint_flow_matching_loss

    torch.manual_seed(args.seed)
    cfg = WNMConfig.from_size("tiny", num_layers=1, text_max_length=64, pooled_text_modulation=args.pooled_text)
    model = WNMModel(cfg)
    rng = np.random.default_rng(args.seed)
    history = rng.integers(0, 255, (cfg.history_frames, *cfg.image_size, 3), dtype=np.uint8)
    target = rng.integers(0, 255, (cfg.target_frames, *cfg.image_size, 3), dtype=np.uint8)
    goals = (("yellow plant", 0.3), ("white shelf", -0.3), ("red chair", 0.0))  # object -> turn rate (rad/step)
    examples = []
    for k in range(6):
        for name, turn in goals:
            actions = np.zeros((cfg.action_steps, 4))
            actions[:, 0], actions[:, 2] = 0.1, turn
            texts = (f"Go to the study and stop next to the {name}.", f"Walk over to the {name} in the study.")
            examples.append(sft.ExpertExample(f"e{k}_{name}", history, target, actions, texts))
    rows = sft.encode_examples(model, examples, batch=len(examples), progress=False, calibrate=True,
                               fit_normalization=True)  # fmt: skip
    sft_cfg = sft.SFTConfig(steps=args.steps, batch_size=16, lr=1e-3, action_weight=4.0, eval_every=args.steps,
                            eval_rows=rows.rows, seed=args.seed, train_encoders=("text_encoder",))  # fmt: skip
    sft.train_sft(model, rows, rows, sft_cfg, progress=True)
    model.eval()
    # Rows come as (example, template): rows 2e and 2e+1 belong to example e, whose object is e % 3; the row
    # two further on names the next object.
    own = torch.arange(rows.rows)
    other = (own + 2) % rows.rows
    g = torch.Generator().manual_seed(1)
    loss = {"own instruction": 0.0, "instruction of another object": 0.0}
    repeats = 4
    with torch.no_grad():
        for _ in range(repeats):
            x0, a0, s, ev, ea = draw_noise(rows, own, g)
            hist, feats = rows.features(own)
            _, feats_other = rows.features(other)
            swapped = {**feats, "text": feats_other["text"], "text_mask": feats_other["text_mask"]}
            for key, f in zip(loss, (feats, swapped), strict=True):
                ctx = model.context_from_features(hist, f)
                _, parts = joint_flow_matching_loss(model.transformer, ctx, x0, a0, s, ev, ea, 4.0)
                loss[key] += parts["action"] / repeats
    print(json.dumps({"steps": args.steps, "pooled_text": args.pooled_text, "action_loss": loss}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
