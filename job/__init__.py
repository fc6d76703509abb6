"""Multi-GPU training job template (python -m job)."""
