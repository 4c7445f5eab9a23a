"""Stage-III trainer: config schema, driver loop, checkpoints, logging."""
