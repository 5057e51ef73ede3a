"""Engine statistics: what each step reports, and the loggers (Prometheus, periodic log line) that read it."""
