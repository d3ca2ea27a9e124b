"""The REST API (model management, OpenAI-compatible serving, Prometheus metrics)."""
