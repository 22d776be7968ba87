"""Training: process groups, optimizer and schedule, checkpoints, metrics and the training loop.

Nothing here starts a process group at import time; ``facepipe.training.distributed`` does it when
asked.
"""
