"""What both HTTP fronts of the emulator route with: a request as the handlers see it, a router of
method + path patterns, the standard system parameters every Google API accepts, and request bodies parsed
with the clients' own message types."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from google.protobuf import json_format

from tpurun.emulator.model import invalid

Handler = Callable[["Request"], Any]

# Query parameters every Google API accepts on every method (its "system parameters"): the response format
# (`alt`, only json here), partial responses (`fields`), indentation (`prettyPrint`), the error format
# (`$.xgafv`), quota attribution (`quotaUser`, `userIp`), credentials in the URL, JSONP.
SYSTEM_PARAMS = frozenset(
    {
        "alt",
        "fields",
        "prettyPrint",
        "quotaUser",
        "userIp",
        "$.xgafv",
        "key",
        "access_token",
        "oauth_token",
        "callback",
        "upload_protocol",
        "uploadType",
    }
)


class Request:
    def __init__(self, method: str, path: str, query: dict[str, list[str]], body: bytes, groups: dict[str, str]):
        self.method = method
        self.path = path
        self.query = query
        self.body = body
        self.groups = groups

    def q(self, key: str, default: str = "") -> str:
        vals = self.query.get(key)
        return vals[-1] if vals else default

    def q_int(self, key: str) -> int:
        raw = self.q(key, "0")
        try:
            return int(raw)
        except ValueError as e:
            raise invalid(f"Invalid value at '{key}' (TYPE_INT32), \"{raw}\"") from e

    def q_bool(self, key: str) -> bool:
        return self.q(key, "false").lower() in ("true", "1")

    def text(self) -> str:
        return self.body.decode("utf-8") if self.body else "{}"

    def json(self) -> dict[str, Any]:
        try:
            data = json.loads(self.text())
        except ValueError as e:
            raise invalid(f"Invalid JSON payload received. {e}") from e
        if not isinstance(data, dict):
            raise invalid("Invalid JSON payload received. Expected an object.")
        return data


def parse_message(cls: Any, req: Request, where: str) -> Any:
    """REQ's body as a proto-plus CLS; unknown fields and bad values are 400s in the API's words."""
    try:
        return cls.from_json(req.text(), ignore_unknown_fields=False)
    except json_format.ParseError as e:
        msg = str(e).splitlines()[0]
        m = re.search(r'has no field named "([^"]+)"', msg)
        if m:
            raise invalid(
                f"Invalid JSON payload received. Unknown name \"{m.group(1)}\" at '{where}': Cannot find field."
            ) from e
        raise invalid(f"Invalid JSON payload received. {msg}") from e


class Router:
    def __init__(self) -> None:
        self.routes: list[tuple[str, re.Pattern[str], Handler, frozenset[str]]] = []

    def add(self, method: str, pattern: str, handler: Handler, params: tuple[str, ...] = ()) -> None:
        self.routes.append((method, re.compile(f"^{pattern}$"), handler, frozenset(params)))

    def match(self, method: str, path: str) -> tuple[Handler, dict[str, str], frozenset[str]] | None:
        for m, rx, h, params in self.routes:
            if m == method:
                hit = rx.match(path)
                if hit:
                    return h, hit.groupdict(), params
        return None


# ---------------------------------------------------------------- system parameters on the answer


def _split_top(spec: str) -> list[str]:
    """SPEC's comma-separated terms, commas inside parentheses kept."""
    terms, depth, cur = [], 0, ""
    for ch in spec:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise invalid(f"Invalid field selection {spec}")
        if ch == "," and depth == 0:
            terms.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise invalid(f"Invalid field selection {spec}")
    terms.append(cur.strip())
    if any(not t for t in terms):
        raise invalid(f"Invalid field selection {spec}")
    return terms


def _selection(spec: str) -> dict[str, Any]:
    """A `fields` mask as a tree: {'items': {'name': {}, 'id': {}}, 'nextPageToken': {}}; {} selects all below."""
    tree: dict[str, Any] = {}
    for term in _split_top(spec):
        sub = ""
        if term.endswith(")"):
            term, _, sub = term[:-1].partition("(")
        node = tree
        for part in term.split("/"):
            if not re.fullmatch(r"[A-Za-z0-9_$.@-]+|\*", part):
                raise invalid(f"Invalid field selection {spec}")
            node = node.setdefault(part, {})
        if sub:
            node.update(_selection(sub))
    return tree


def _apply(value: Any, tree: dict[str, Any]) -> Any:
    if not tree:
        return value
    if isinstance(value, list):
        return [_apply(v, tree) for v in value]
    if not isinstance(value, dict):
        return value
    if "*" in tree:
        return {k: _apply(v, tree["*"]) for k, v in value.items()}
    return {k: _apply(value[k], sub) for k, sub in tree.items() if k in value}


def render(payload: Any, req: Request | None) -> bytes:
    """An answer as the system parameters of REQ ask for it: only the `fields` selected (answers, not errors),
    indented unless `prettyPrint=false`. Only `alt=json` is offered."""
    if req is not None:
        alt = req.q("alt", "json")
        if alt != "json":
            raise invalid(f"Invalid value at 'alt' ({alt}): this service answers only alt=json.")
        fields = req.q("fields")
        if fields and "error" not in payload:
            payload = _apply(payload, _selection(fields))
        if req.q("prettyPrint", "true").lower() == "false":
            return json.dumps(payload, separators=(",", ":")).encode()
    return json.dumps(payload, indent=2).encode()
