"""Running a plan: stages of bound kernels, batching, queues, per-stage timing, item errors."""
