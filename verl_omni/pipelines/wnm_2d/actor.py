"""The WNM-2D baseline trains with the same actor as WNM-3D: the variants differ in their context tokens only.

:class:`~verl_omni.pipelines.wnm_3d.actor.WNMDiffusionActor` never looks at the context's content (it passes the
``WNMContext`` through to the DiT), so one class serves both; this module names it for the 2D package.
"""

from __future__ import annotations

from verl_omni.pipelines.wnm_3d.actor import UpdateMicroBatch, WNMDiffusionActor, lr_multiplier

__all__ = ["UpdateMicroBatch", "WNMDiffusionActor", "lr_multiplier"]
