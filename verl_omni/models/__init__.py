"""Model definitions used by the trainer, the rollout backends and the checkpoint tools."""
