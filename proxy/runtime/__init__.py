"""Process plumbing: the I/O and CPU pools, the task group, metrics, logging."""
