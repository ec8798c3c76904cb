"""Checkpoints: writing, keeping, listing and resuming from them, and the model they hold."""
