"""GRPO on a verifiable digit task: a trainer process feeding a kvrunner engine by
IPC weight pushes (see README.md here, and run.py)."""
