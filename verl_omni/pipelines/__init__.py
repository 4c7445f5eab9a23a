"""Rollout pipelines for WNM world-action models.

``wnm_shared`` holds the mechanics every WNM variant shares (layer table, sigma schedule, SDE step and
log-probs, request RNG, counterfactual stratified sampling, rollout backends); ``wnm_3d`` and ``wnm_2d`` each
hold their variant's :class:`~verl_omni.pipelines.wnm_shared.pipeline.VariantPipeline` (model, backend, actor),
which :func:`pipeline_for` picks by name.
"""

from __future__ import annotations

import importlib

from verl_omni.contracts import VARIANTS


def pipeline_for(variant: str):
    """The ``VariantPipeline`` of ``variant`` (``verl_omni.pipelines.<variant>.PIPELINE``).

    Raises:
        ValueError: ``variant`` is not one of ``VARIANTS``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"model.variant {variant!r} has no pipeline package; choose one of {list(VARIANTS)}")
    return importlib.import_module(f"verl_omni.pipelines.{variant}").PIPELINE


__all__ = ["pipeline_for"]
