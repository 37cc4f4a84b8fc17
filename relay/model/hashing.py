"""sha256 and sha1 without importing OpenSSL: CPython's builtin modules load in microseconds, while
`hashlib` pulls in `_hashlib` (~4-6 ms of every launch on a slow machine). sha1 is git's object id
(the index checksum, blob ids), never a security decision of ours."""

try:
    from _sha256 import sha256  # noqa: F401 - re-exported; CPython <= 3.11
except ImportError:  # pragma: no cover - other Pythons
    try:
        from _sha2 import sha256  # noqa: F401 - re-exported; CPython 3.12+
    except ImportError:
        from hashlib import sha256  # noqa: F401 - re-exported

try:
    from _sha1 import sha1  # noqa: F401 - re-exported
except ImportError:  # pragma: no cover - other Pythons
    from hashlib import sha1  # noqa: F401 - re-exported
