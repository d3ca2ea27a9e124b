"""Serving core: supervisor, worker, replica model actors, routing and metrics."""
