"""Training with TRL: the TRL bridge, the training loop glue, checkpoints, early stopping, the tiny model."""
