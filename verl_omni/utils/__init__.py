"""Utilities shared by the trainer and workers (reward scoring lives in ``reward_score``)."""
