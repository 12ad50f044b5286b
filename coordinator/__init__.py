"""The coordinator: CLI, supervision, job store."""
