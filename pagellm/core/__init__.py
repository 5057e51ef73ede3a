"""Scheduling and KV-block bookkeeping. Pure Python: never imports torch."""
