"""sha256 without importing OpenSSL: CPython's builtin module loads in microseconds, while
`hashlib` pulls in `_hashlib` (~4 ms of every launch on a slow machine)."""

try:
    from _sha256 import sha256  # noqa: F401 - re-exported; CPython <= 3.11
except ImportError:  # pragma: no cover - other Pythons
    try:
        from _sha2 import sha256  # noqa: F401 - re-exported; CPython 3.12+
    except ImportError:
        from hashlib import sha256  # noqa: F401 - re-exported

