"""Synthetic GN0 world: floor plans, expert planner, ray-casting renderer, DAgger collector, event labels."""
