"""How workers are run: in this process for now; multi-process and Ray executors share the Worker."""
