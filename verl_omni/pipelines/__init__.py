"""Rollout pipelines for WNM world-action models.

``wnm_shared`` holds the mechanics every WNM variant shares (layer table, sigma schedule, SDE step and
log-probs, request RNG, counterfactual stratified sampling, rollout backends); ``wnm_3d`` and ``wnm_2d``
only pick the model variant.
"""
