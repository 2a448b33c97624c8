"""Training: host-side data pipelines, sharded checkpoints and the training loop."""
