"""Fault injection for the trainer e2e tests: non-finite gradients in the actor workers.

The driver passes ``WAM_RAY_WORKER_SETUP_HOOK=nonfinite_grad_hook.install`` to Ray, which calls
:func:`install` in every worker process before it runs anything. The hook registers a global forward hook
on every ``torch.nn.Linear``: while autograd records (only the PPO update's log-prob recompute does; rollouts,
validation and old-log-prob recompute run without gradients) it attaches a gradient hook to the output that
turns the gradient flowing back through it into NaN. Forward values, log-probs and the loss stay finite;
every parameter gradient is NaN, so the update must be skipped and counted.
"""

from __future__ import annotations


def install() -> None:
    import torch

    def poison(module, args, output):
        if torch.is_grad_enabled() and isinstance(module, torch.nn.Linear) and isinstance(output, torch.Tensor):
            if output.requires_grad:
                output.register_hook(lambda grad: grad * float("nan"))
        return None

    torch.nn.modules.module.register_module_forward_hook(poison)
