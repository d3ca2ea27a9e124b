"""Authentication and permissions for the REST API (see ``docs/security.md``)."""

from .middleware import AuthMiddleware
from .routes import auth_router
from .service import AuthService

__all__ = ["AuthMiddleware", "AuthService", "auth_router"]
