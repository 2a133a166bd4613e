"""What users type for Cloud TPU resources -- names, zones, durations, amounts of money: checked locally, before
anything reaches the API."""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Sequence

from tpurun.errors import UsageError

NAME_RE = re.compile(r"^[a-z](?:[a-z0-9-]{0,61}[a-z0-9])?$")


def _checked(pattern: re.Pattern[str], value: str, problem: str) -> str:
    if not pattern.match(value or ""):
        raise UsageError(problem)
    return value


def validate_name(name: str) -> str:
    return _checked(
        NAME_RE,
        name,
        f"invalid TPU name {name!r}: use 1-63 lowercase letters, digits and '-', starting with a letter "
        "and not ending with '-'",
    )


def worker_name(index: int, slice_id: int | None = None) -> str:
    """How output names a worker: w3, or s1/w1 (INDEX within its slice) in a multislice TPU."""
    return f"s{slice_id}/w{index}" if slice_id is not None else f"w{index}"


# region-zone as Compute Engine names them: us-central2-b, europe-west4-a, asia-northeast1-b
ZONE_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")


def validate_zone(zone: str) -> str:
    return _checked(
        ZONE_RE,
        zone,
        f"{zone!r} is not a zone: Cloud TPU zones look like us-central2-b or europe-west4-a "
        "(`gcloud compute tpus locations list` shows them)",
    )


def parse_duration(text: str) -> int:
    """'6h', '30m', '2d', '90s' or seconds -> seconds."""
    m = re.match(r"^(\d+)([smhd]?)$", text.strip())
    if not m:
        raise UsageError(f"invalid duration '{text}': use e.g. 90s, 30m, 6h or 2d")
    return int(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def parse_usd(text: str, option: str = "--budget") -> float:
    """'25', '0.05', '$1,000' -> US dollars, more than 0 (a budget of nothing would stop everything at once)."""
    t = text.strip().lstrip("$").replace(",", "")
    if not re.fullmatch(r"\d+(\.\d*)?|\.\d+", t):
        raise UsageError(f"{option} {text}: not an amount of US dollars; use e.g. 25 or 0.50")
    usd = float(t)
    if usd <= 0:
        raise UsageError(f"{option} {text}: a budget must be more than 0 US dollars")
    return usd


# ---------------------------------------------------------------------------- sets of workers, folded
#
# How output names several workers at once, as ClusterShell's NodeSet folds node names: the numbers of names
# that differ only in them are folded into brackets, `w[0-4,6-2047]`, `s[0-3]/w[0-255]`, `w[0-1]/c[0-3]`
# (one number alone keeps no brackets: `w5`); items that do not fold together are joined by commas,
# `s0/w[0-255],s1/w[0-3,5-255]`. `--worker` takes the folded form back (`parse_worker_spec`; quote it in
# the shell, which would read the brackets as a pattern).

_NUMBER = re.compile(r"(\d+)")


def _axes(name: str) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """NAME as its text between numbers and its numbers (w12 -> ("w", ""), (12,)); None where a number has a
    leading zero or the name holds a bracket or a comma: it is then kept as it is, never folded."""
    if any(c in name for c in "[],"):
        return None
    pieces = _NUMBER.split(name)
    numbers = pieces[1::2]
    if any(len(n) > 1 and n.startswith("0") for n in numbers):
        return None
    return tuple(pieces[0::2]), tuple(int(n) for n in numbers)


def _ranges(values: list[int]) -> str:
    """Sorted distinct VALUES as `5`, or `[0-4,6,8-9]`."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    if len(values) == 1:
        return str(values[0])
    return "[" + ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) + "]"


def _fold_numbers(points: set[tuple[int, ...]]) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """POINTS (tuples of as many numbers each) folded, the last axis first: (the first point, each axis's
    ranges) per item, in the order of their first points."""
    if not next(iter(points)):
        return [((), ())]
    by_head: dict[tuple[int, ...], list[int]] = {}
    for p in points:
        by_head.setdefault(p[:-1], []).append(p[-1])
    heads_by_last: dict[str, set[tuple[int, ...]]] = {}
    firsts: dict[str, int] = {}
    for head, lasts in by_head.items():
        lasts.sort()
        last = _ranges(lasts)
        heads_by_last.setdefault(last, set()).add(head)
        firsts[last] = lasts[0]
    items = []
    for last, heads in heads_by_last.items():
        for first, axes in _fold_numbers(heads):
            items.append(((*first, firsts[last]), (*axes, last)))
    return sorted(items)


def fold(names: Iterable[str]) -> str:
    """NAMES (w3, s1/w3, w0/c1, ...) as one folded set: `w[0-4,6]`; the same whatever their order."""
    kept: set[str] = set()
    shapes: dict[tuple[str, ...], set[tuple[int, ...]]] = {}
    for name in names:
        split = _axes(name)
        if split is None:
            kept.add(name)
        else:
            shapes.setdefault(split[0], set()).add(split[1])
    items: list[tuple[tuple[int, ...], tuple[str, ...], str]] = []
    for texts, points in shapes.items():
        for first, axes in _fold_numbers(points):
            text = "".join(t + a for t, a in zip(texts, (*axes, ""), strict=True))
            items.append((first, texts, text))
    items.sort()
    return ",".join([text for _, _, text in items] + sorted(kept))


def unfold(text: str) -> list[str]:
    """A folded set's names, in its order (`w[0-2]` -> w0, w1, w2). ValueError where TEXT is not one."""
    names: list[str] = []
    for item in split_items(text):
        pieces = re.split(r"\[([^\[\]]*)\]", item)
        if "[" in "".join(pieces[0::2]) or "]" in "".join(pieces[0::2]) or not item:
            raise ValueError(f"not a set of workers: {text!r}")
        axes = [[piece] if i % 2 == 0 else [str(v) for v in _numbers(piece)] for i, piece in enumerate(pieces)]
        if math.prod(map(len, axes)) + len(names) > MAX_UNFOLDED:
            raise ValueError(f"more than {MAX_UNFOLDED:,} names in {text!r}")
        expanded = [""]
        for values in axes:
            expanded = [done + v for done in expanded for v in values]
        names += expanded
    return names


MAX_UNFOLDED = 100_000  # names a set may stand for (the largest multislice jobs have about 10,000 hosts)


def _numbers(ranges: str) -> list[int]:
    """`0-4,6` -> 0, 1, 2, 3, 4, 6."""
    values: list[int] = []
    for part in ranges.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"not a range of numbers: {part!r}")
        if int(m.group(2) or m.group(1)) - int(m.group(1)) >= MAX_UNFOLDED:
            raise ValueError(f"more than {MAX_UNFOLDED:,} numbers in {part!r}")
        values += range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1)
    return values


def split_items(text: str) -> list[str]:
    """TEXT cut at its commas outside brackets: `w[0-3,5],s1` -> `w[0-3,5]`, `s1`."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [*items, text[start:]]


def spec_words(spec: str, multislice: bool) -> list[str]:
    """The words of a `--worker` SPEC: a folded set unfolded into its names (`w[0-2]` -> w0, w1, w2), and on a
    TPU of one slice a worker's name as its index (`w3` -> 3, `w1-3` -> 1-3). ValueError where brackets do
    not make a set."""
    words = []
    for item in split_items(spec):
        item = item.strip()
        for word in unfold(item) if "[" in item or "]" in item else [item]:
            m = None if multislice else re.fullmatch(r"w(\d+(?:-\d+)?)", word)
            words.append(m.group(1) if m else word)
    return words


def shown(names: Collection[str], width: int = 60) -> str:
    """NAMES folded for a line that fits a screen: at most WIDTH characters, ending `…]` where cut (the whole
    set is in --json and in each command's per-worker form)."""
    text = fold(names)
    if len(text) <= width:
        return text
    cut = text[: max(width - 2, 1)]
    if cut.rfind(",") > 0:
        cut = cut[: cut.rfind(",") + 1]  # whole numbers and names only
    return cut + "…" + ("]" if cut.count("[") > cut.count("]") else "")


EACH_UP_TO = 8  # workers named one by one (a row or a line each); more are folded, grouped by outcome
WIDTH = 60  # characters of a folded set in a line or a table's cell


def which(names: Collection[str]) -> str:
    """NAMES for a line or a row: folded, cut to WIDTH."""
    return shown(names, WIDTH)


def listed(names: Sequence[str], sep: str = ", ") -> str:
    """NAMES in a line: each of a few (EACH_UP_TO) joined by SEP, else folded within WIDTH."""
    return sep.join(names) if len(names) <= EACH_UP_TO else which(names)


def count(n: int, what: str = "worker") -> str:
    """`1 worker`, `2,045 workers`."""
    return f"{n:,} {what}{'' if n == 1 else 'es' if what.endswith('s') else 's'}"


_LABEL = r"(?:s\d+/)?w\d+"  # any worker's label: `w12`, `s3/w12`
REASONS_UP_TO = 10  # distinct reasons said, one line each; the rest counted in one line


def reason(why: str, name: str = "") -> str:
    """WHY without the workers it is about (its NAME, or any worker's label such as the relay a subtree was lost
    with, and an address in brackets after one): what two workers that failed alike share."""
    who = f"{re.escape(name)}|{_LABEL}" if name else _LABEL
    pattern = rf"(?<![\w/])(?:{who})(?![\w/])( \([^)]*\))?"
    return re.sub(pattern, "…", why)


def by_reason(failures: Sequence[tuple[str, str]]) -> list[str]:
    """(name, why) FAILURES as one line per distinct reason, the most common first: the first worker's own
    words, then the workers alike, folded: `… connection refused (and 2,039 more workers alike: w[8-2047])`;
    past REASONS_UP_TO reasons (a changed host key is always said), one line counts the rest."""
    alike: dict[str, list[tuple[str, str]]] = {}
    for name, why in failures:
        alike.setdefault(reason(why, name), []).append((name, why))
    lines = []
    groups = sorted(alike.values(), key=len, reverse=True)  # stable: ties in the order they came
    # a changed host key is always said: it may be one worker's, the rarest reason of all
    said: list[list[tuple[str, str]]] = []
    unsaid: list[list[tuple[str, str]]] = []
    for i, group in enumerate(groups):
        (said if i < REASONS_UP_TO or "HOST KEY" in group[0][1] else unsaid).append(group)
    for group in said:
        first, why = group[0]
        rest = [name for name in dict.fromkeys(name for name, _ in group) if name != first]
        if names_them(group):
            rest = []  # (a relay lost with its subtree: the reason names its workers itself)
        lines.append(why + (f" (and {count(len(rest), 'more worker')} alike: {which(rest)})" if rest else ""))
    if unsaid:
        others = list(dict.fromkeys(name for group in unsaid for name, _ in group))
        lines.append(f"{count(len(unsaid), 'other reason')} on {count(len(others))}: {which(others)}")
    return lines


def names_them(group: Sequence[tuple[str, str]], least: int = 1) -> bool:
    """Whether the (name, why) of GROUP, of at least LEAST workers, are one reason in the same words that names
    every worker of the group, folded (what a relay lost with its subtree tells each worker of it)."""
    whys = {why for _, why in group}
    names = list(dict.fromkeys(name for name, _ in group))
    return len(names) >= least and len(whys) == 1 and which(names) in whys.pop()


def each_or_by_reason(failures: Sequence[tuple[str, str]], among: int = 0) -> list[str]:
    """(name, why) FAILURES as lines: one each where they come from a few workers (EACH_UP_TO; AMONG: the
    workers asked, where more than those named; the same words of several said once), else one per distinct
    reason (`by_reason`)."""
    few = max(among, len({name for name, _ in failures})) <= EACH_UP_TO
    return list(dict.fromkeys(why for _, why in failures)) if few else by_reason(failures)
