"""A Python client over Xinference's REST API."""

from .restful_client import Client, Model, XinferenceError

__all__ = ["Client", "Model", "XinferenceError"]
