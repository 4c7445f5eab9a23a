"""Fault injection for the trainer e2e tests: non-finite gradients in the actor workers.

The driver passes ``WAM_RAY_WORKER_SETUP_HOOK=nonfinite_grad_hook.install`` to Ray, which calls
:func:`install` in every worker process before it runs anything. The hook registers a global forward hook
on every ``torch.nn.Linear``: while autograd records (only the PPO update's log-prob recompute does; rollouts,
validation and old-log-prob recompute run without gradients) each output gets ``+ NaN``, so the loss and
every gradient are NaN and the update must be skipped and counted. Nothing is touched outside those forwards.
"""

from __future__ import annotations


def install() -> None:
    import torch

    def poison(module, args, output):
        if torch.is_grad_enabled() and isinstance(module, torch.nn.Linear) and isinstance(output, torch.Tensor):
            return output + float("nan")
        return None

    torch.nn.modules.module.register_module_forward_hook(poison)
