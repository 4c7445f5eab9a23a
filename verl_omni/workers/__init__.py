"""Ray workers: FSDP2 actor with colocated rollout, reward workers."""
