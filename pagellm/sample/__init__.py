"""Turning logits into tokens, vectorized over the batch on the device."""
