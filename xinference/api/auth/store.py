"""Users and API keys in SQLite under ``$XINFERENCE_HOME/auth``, and the secrets
kept beside them.

Passwords are hashed with argon2id (argon2-cffi's defaults). API keys are long
random strings, so a SHA-256 of the key is stored and looked up (a slow KDF adds
nothing to 256 random bits). The directory is 0700 and every file in it 0600,
created so from the start (never chmod'ed after being written).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

from .permissions import ADMIN, check_permissions

KEY_PREFIX = "xk_"
MIN_PASSWORD_LENGTH = 8

_SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    username TEXT PRIMARY KEY,
    password_hash TEXT NOT NULL,
    permissions TEXT NOT NULL,      -- JSON list of permission names
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,        -- public handle, shown in lists
    key_hash TEXT NOT NULL UNIQUE,  -- sha256 hex of the whole key
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    permissions TEXT NOT NULL,      -- JSON list; the owner's must also allow
    created REAL NOT NULL,
    revoked REAL                    -- time of revocation, NULL while valid
);
"""


def auth_dir(home: Path | None = None) -> Path:
    """``$XINFERENCE_HOME/auth`` (default ``~/.xinference/auth``), made 0700."""
    base = home or Path(os.environ.get("XINFERENCE_HOME", Path.home() / ".xinference"))
    path = Path(base) / "auth"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def read_or_create_secret(path: Path, nbytes: int = 32) -> str:
    """The secret in ``path``; created once (0600, exclusively) when missing."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    value = secrets.token_urlsafe(nbytes)
    with os.fdopen(fd, "w") as file:
        file.write(value)
    return value


class UserExists(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class User:
    username: str
    permissions: tuple[str, ...]
    created: float

    def public(self) -> dict[str, object]:
        return {
            "username": self.username,
            "permissions": list(self.permissions),
            "created": self.created,
        }


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str
    owner: str
    name: str
    permissions: tuple[str, ...]
    created: float
    revoked: float | None

    def public(self) -> dict[str, object]:
        return {
            "key_id": self.key_id,
            "owner": self.owner,
            "name": self.name,
            "permissions": list(self.permissions),
            "created": self.created,
            "revoked": self.revoked is not None,
        }


class AuthStore:
    """The database; every method is short and synchronous (argon2 hashing is
    the slow part: callers run ``create_user``/``verify_password`` in a thread)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "auth.db"
        if not self.path.exists():  # created 0600 before sqlite writes to it
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
        self._db = sqlite3.connect(self.path, check_same_thread=False)
        self._lock = threading.Lock()
        self._hasher = PasswordHasher()
        # verifying against this keeps an unknown username as slow as a known one
        self._dummy_hash = self._hasher.hash(secrets.token_urlsafe(16))
        with self._transaction() as db:
            db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._db:
            yield self._db

    # ---- users --------------------------------------------------------------------

    def has_admin(self) -> bool:
        return any(ADMIN in user.permissions for user in self.list_users())

    def create_user(self, username: str, password: str, permissions: list[str]) -> User:
        if not username or len(username) > 64 or not username.isprintable():
            raise ValueError("a username is 1 to 64 printable characters")
        if len(password) < MIN_PASSWORD_LENGTH:
            raise ValueError(
                f"a password has at least {MIN_PASSWORD_LENGTH} characters"
            )
        names = check_permissions(permissions)
        password_hash = self._hasher.hash(password)
        created = time.time()
        try:
            with self._transaction() as db:
                db.execute(
                    "INSERT INTO users VALUES (?, ?, ?, ?)",
                    (username, password_hash, json.dumps(names), created),
                )
        except sqlite3.IntegrityError:
            raise UserExists(f"user {username!r} exists") from None
        return User(username, names, created)

    def get_user(self, username: str) -> User | None:
        with self._transaction() as db:
            row = db.execute(
                "SELECT username, permissions, created FROM users WHERE username = ?",
                (username,),
            ).fetchone()
        return None if row is None else User(row[0], tuple(json.loads(row[1])), row[2])

    def list_users(self) -> list[User]:
        with self._transaction() as db:
            rows = db.execute(
                "SELECT username, permissions, created FROM users ORDER BY username"
            ).fetchall()
        return [User(row[0], tuple(json.loads(row[1])), row[2]) for row in rows]

    def delete_user(self, username: str) -> bool:
        """Remove a user and revoke their keys; False: no such user."""
        with self._transaction() as db:
            deleted = db.execute("DELETE FROM users WHERE username = ?", (username,))
            db.execute(
                "UPDATE api_keys SET revoked = ? WHERE owner = ? AND revoked IS NULL",
                (time.time(), username),
            )
        return deleted.rowcount > 0

    def verify_password(self, username: str, password: str) -> User | None:
        with self._transaction() as db:
            row = db.execute(
                "SELECT password_hash FROM users WHERE username = ?", (username,)
            ).fetchone()
        stored = self._dummy_hash if row is None else row[0]
        try:
            self._hasher.verify(stored, password)
        except (VerificationError, InvalidHashError):
            return None
        return None if row is None else self.get_user(username)

    # ---- API keys -----------------------------------------------------------------

    def create_key(
        self, owner: str, name: str, permissions: list[str]
    ) -> tuple[ApiKey, str]:
        """A new key for ``owner``: its record and the key itself (shown once)."""
        names = check_permissions(permissions)
        key_id = secrets.token_hex(6)
        key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
        created = time.time()
        with self._transaction() as db:
            db.execute(
                "INSERT INTO api_keys VALUES (?, ?, ?, ?, ?, ?, NULL)",
                (key_id, _digest(key), owner, name, json.dumps(names), created),
            )
        return ApiKey(key_id, owner, name, names, created, None), key

    def find_key(self, key: str) -> ApiKey | None:
        """The valid (unrevoked) key record for a presented key."""
        with self._transaction() as db:
            row = db.execute(
                "SELECT key_id, owner, name, permissions, created, revoked "
                "FROM api_keys WHERE key_hash = ? AND revoked IS NULL",
                (_digest(key),),
            ).fetchone()
        return None if row is None else _key(row)

    def list_keys(self, owner: str | None = None) -> list[ApiKey]:
        query = (
            "SELECT key_id, owner, name, permissions, created, revoked FROM api_keys"
        )
        with self._transaction() as db:
            if owner is None:
                rows = db.execute(query + " ORDER BY created").fetchall()
            else:
                rows = db.execute(
                    query + " WHERE owner = ? ORDER BY created", (owner,)
                ).fetchall()
        return [_key(row) for row in rows]

    def revoke_key(self, key_id: str) -> ApiKey | None:
        """Revoke a key (from the next request on); None: no such key."""
        with self._transaction() as db:
            db.execute(
                "UPDATE api_keys SET revoked = ? WHERE key_id = ? AND revoked IS NULL",
                (time.time(), key_id),
            )
            row = db.execute(
                "SELECT key_id, owner, name, permissions, created, revoked "
                "FROM api_keys WHERE key_id = ?",
                (key_id,),
            ).fetchone()
        return None if row is None else _key(row)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _key(row: tuple) -> ApiKey:
    return ApiKey(row[0], row[1], row[2], tuple(json.loads(row[3])), row[4], row[5])
