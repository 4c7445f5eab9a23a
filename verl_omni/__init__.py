"""WNM-3D-RL: Stage-III reinforcement-learning post-training for WNM world-action models.

Importing this package pulls in only its base dependencies (torch, numpy, scipy, pyarrow); the
trainer, model building blocks and optional rollout backends import their heavy dependencies lazily.
"""

__version__ = "0.1.0"
