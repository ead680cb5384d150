"""What a peer sends the scheduler's guard, checked before any of it is used, and peer text made safe for a log line.

Anyone who can reach the scheduler's port can send any msgpack: a `versions` that is a list, a `packages` that is a
string, a worker name with a newline (which would start a forged line in the scheduler's log), a 100 KB role. The
guard reads nothing a peer sent without these checks: a request that fails them is answered with a refusal that
says what was wrong, never with an exception in the scheduler, and every peer-supplied string that reaches a log line
goes through `shown()` (escaped, truncated).

Pure functions, standard library only.
"""
from __future__ import annotations

# The longest peer-supplied text shown in a log line (the rest is counted, not shown).
SHOWN_CHARS = 120
# Worker names (Kubernetes pod names are at most 253 characters), addresses and client ids.
MAX_NAME_CHARS = 255
# The identity's wire form of a full image is 1-3 KB ('name==version' for every distribution); far more is not an
# environment.
MAX_PACKAGES_CHARS = 256 * 1024
# Distribution names and versions in `versions.packages`, and the short identity fields.
MAX_FIELD_CHARS = 200
MAX_PACKAGES = 5000
ROLES = ("worker", "client")


class PeerMessageError(ValueError):
    """What is wrong with a peer's message, as a phrase ("versions is a list, expected a mapping")."""


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """Peer-supplied text as it may appear in a log line: control and other non-printable characters escaped (a
    newline becomes the two characters backslash-n), at most `limit` characters of it, and how many were left out."""
    text = value if isinstance(value, str) else repr(value)
    cut = text[:limit]
    out = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in cut)
    return out + (f"...(+{len(text) - limit} chars)" if len(text) > limit else "")


def _type(value: object) -> str:
    return {dict: "a mapping", list: "a list", tuple: "a list", str: "a string", bytes: "bytes", int: "a number",
            float: "a number", bool: "a boolean", type(None): "nothing"}.get(type(value), type(value).__name__)


def _text(what: str, value: object, limit: int) -> str:
    if not isinstance(value, str):
        raise PeerMessageError(f"{what} is {_type(value)}, expected text")
    if len(value) > limit:
        raise PeerMessageError(f"{what} has {len(value)} characters, at most {limit} expected")
    return value


def name(what: str, value: object, limit: int = MAX_NAME_CHARS) -> str:
    """A worker name, address or client id: text (or a number, as dask allows for names) without control characters,
    at most `limit` characters. Returned as text."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    text = _text(what, value, limit)
    if not text.isprintable():
        raise PeerMessageError(f"{what} contains control characters")
    return text


def mapping(what: str, value: object) -> dict | None:
    """A mapping a peer sent (None: none)."""
    if value is not None and not isinstance(value, dict):
        raise PeerMessageError(f"{what} is {_type(value)}, expected a mapping")
    return value


def label(value: object) -> str:
    """How a worker that asks names itself ("NAME (ADDRESS)")."""
    return name("its name", value, 2 * MAX_NAME_CHARS + 3)


def role(value: object) -> str:
    text = _text("role", value, MAX_FIELD_CHARS) if isinstance(value, str) else None
    if text not in ROLES:
        raise PeerMessageError(f"role {shown(value)} is not one of {', '.join(ROLES)}")
    return text


def ident(value: object) -> dict | None:
    """Our identity as a peer sent it (None: it sent none): a mapping of text fields, `packages` bounded."""
    if mapping("its identity", value) is None:
        return None
    out = {}
    for key, field in value.items():
        if not isinstance(key, str):
            raise PeerMessageError(f"its identity has a key that is {_type(key)}")
        limit = MAX_PACKAGES_CHARS if key == "packages" else MAX_FIELD_CHARS
        if field is not None:
            out[key] = _text(f"identity field {shown(key, 40)}", field, limit)
    return out


def versions(value: object) -> dict | None:
    """distributed's `versions` as a peer sent it (None: none): {"host": {str: text}, "packages": {str: text|None},
    our identity under its key (checked by `ident`), anything else dropped}."""
    if mapping("versions", value) is None:
        return None
    out: dict = {}
    for section in ("host", "packages"):
        part = mapping(f"versions.{section}", value.get(section))
        if part is None:
            continue
        if len(part) > MAX_PACKAGES:
            raise PeerMessageError(f"versions.{section} has {len(part)} entries, at most {MAX_PACKAGES} expected")
        clean = {}
        for key, field in part.items():
            key = _text(f"a versions.{section} key", key, MAX_FIELD_CHARS)
            if field is None:
                clean[key] = None
            elif isinstance(field, (str, int, float)) and not isinstance(field, bool):
                clean[key] = _text(f"versions.{section}[{shown(key, 40)}]", str(field), MAX_FIELD_CHARS)
            else:
                raise PeerMessageError(f"versions.{section}[{shown(key, 40)}] is {_type(field)}, expected text")
        out[section] = clean
    return out
