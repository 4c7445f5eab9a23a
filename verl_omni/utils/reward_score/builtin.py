"""Imports the built-in reward modules so that their ``@register_reward`` decorators run."""

from verl_omni.utils.reward_score import collision, flow, navigation, stop, vision, yaw  # noqa: F401
