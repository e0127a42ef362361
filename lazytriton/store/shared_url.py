"""What ``LAZYTRITON_SHARED`` names: its URL, parsed and checked (``parse_url``), without opening anything.

Read by the settings (``config``), which check the variable when it is set, and by ``store.shared``, which
opens the tier it names.
"""

from __future__ import annotations

from urllib.parse import SplitResult, parse_qsl, urlsplit, urlunsplit

from lazytriton.record import record
from lazytriton.store.lease import DEFAULT_LEASE_S

SCHEMES = ("file", "redis", "rediss")
_PARAMS = {"file": ("lease_s",), "redis": ("lease_s", "prefix"), "rediss": ("lease_s", "prefix")}


@record
class SharedURL:
    """A parsed ``LAZYTRITON_SHARED``: scheme, where (a path or a Redis URL without our parameters), options."""

    scheme: str
    location: str
    lease_s: float = DEFAULT_LEASE_S
    prefix: str = "lazytriton"


def parse_url(url: str) -> SharedURL:
    """Parse a ``LAZYTRITON_SHARED`` value; raise ValueError naming the variable, the value and what is expected."""
    if not isinstance(url, str):
        raise TypeError(f"LAZYTRITON_SHARED must be a str, got {type(url).__name__}")
    parts = urlsplit(url.strip())
    url = _redacted(parts)  # what error messages show: never a password
    if parts.scheme not in SCHEMES:
        raise ValueError(f"LAZYTRITON_SHARED must start with file://, redis:// or rediss://, got {url!r}")
    if parts.fragment:
        raise ValueError(f"LAZYTRITON_SHARED: no #fragment is expected, got {url!r}")
    options = _options(url, parts.scheme, parts.query)
    lease_s = _lease_s(options.get("lease_s"))
    prefix = options.get("prefix", "lazytriton")
    if not 1 <= len(prefix) <= 64 or not all(c in _PREFIX_CHARS for c in prefix):
        raise ValueError(f"LAZYTRITON_SHARED: prefix must be 1-64 characters of [A-Za-z0-9_-.:], got {prefix!r}")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"LAZYTRITON_SHARED: a shared directory is file:///absolute/path, got {url!r}")
        return SharedURL("file", parts.path, lease_s)
    _check_redis_location(url, parts)
    location = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
    return SharedURL(parts.scheme, location, lease_s, prefix)


def _redacted(parts: SplitResult) -> str:
    """The URL with any password replaced by ``***``."""
    if "@" not in parts.netloc:
        return parts.geturl()
    user, _, host = parts.netloc.rpartition("@")
    return parts._replace(netloc=f"{user.partition(':')[0]}:***@{host}").geturl()


_PREFIX_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.:")
# Redis' own bound on ``databases`` (an int in its config).
_MAX_DB = 2**31 - 1


def _options(url: str, scheme: str, query: str) -> dict[str, str]:
    """The query parameters: each known for ``scheme``, each given once, each ``name=value``."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(f"LAZYTRITON_SHARED: the query must be name=value pairs joined by &, got {url!r}") from None
    options: dict[str, str] = {}
    for name, value in pairs:
        if name not in _PARAMS[scheme]:
            raise ValueError(f"LAZYTRITON_SHARED: unknown parameter {name!r} in {url!r} "
                             f"(known for {scheme}: {', '.join(_PARAMS[scheme])})")
        if name in options:
            raise ValueError(f"LAZYTRITON_SHARED: parameter {name!r} given twice in {url!r}")
        options[name] = value
    return options


def _lease_s(value: str | None) -> float:
    """The ``lease_s`` parameter: seconds within 0.05..3600 (NaN and infinities are not)."""
    if value is None:
        return DEFAULT_LEASE_S
    try:
        lease_s = float(value)
    except ValueError:
        raise ValueError(f"LAZYTRITON_SHARED: lease_s must be a number of seconds, got {value!r}") from None
    if not 0.05 <= lease_s <= 3600:
        raise ValueError(f"LAZYTRITON_SHARED: lease_s must be within 0.05..3600 seconds, got {value!r}")
    return lease_s


def _check_redis_location(url: str, parts: SplitResult) -> None:
    """A host, a port within 1..65535 (or none: 6379) and a database number (``/0``, or none)."""
    if not parts.hostname:
        raise ValueError(f"LAZYTRITON_SHARED: a Redis URL needs a host, got {url!r}")
    host_port = parts.netloc.rpartition("@")[2]
    port = host_port.rpartition("]")[2].partition(":")[2] if ":" in host_port.rpartition("]")[2] else "6379"
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"LAZYTRITON_SHARED: a Redis port must be a number within 1..65535, got {port!r} in {url!r}")
    db = parts.path[1:] if parts.path.startswith("/") else parts.path
    if db and not (db.isascii() and db.isdigit() and int(db) <= _MAX_DB):
        raise ValueError(f"LAZYTRITON_SHARED: a Redis database is a number, as in redis://host:6379/0, "
                         f"got {parts.path!r} in {url!r}")
