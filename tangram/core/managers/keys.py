"""API key pools: several keys of one API, each with its own rate limits (issue 14, item 4).

Real providers limit each key: requests per minute (RPM), tokens per minute (TPM) and
requests in flight; labs hold several keys. A lease of an API with keys gets one key that
has room for it, and the key's budget is charged when the lease is granted.

Contract:

1. Keys are known by name only (``ApiKey.name``, e.g. ``k0``): the core never sees a
   secret. The driver hands the secret to the lease's holder and to nobody else.
2. A key's minute is a sliding window: the leases granted in the last ``WINDOW_S`` seconds,
   each with its token charge. A key has room for a lease of ``units`` requests and
   ``tokens`` tokens when it is not cooling down, its requests in the window plus ``units``
   stay within ``rpm``, its tokens plus ``tokens`` within ``tpm``, and its leases in flight
   below ``concurrency`` (a limit of 0 is no limit).
3. Among the keys with room the one with the most headroom wins (the smallest fraction of
   any of its limits in use, then the key's order): load spreads over the keys.
4. The holder reports what the call used: ``tokens`` replaces the lease's charge in the
   window (a provider that charges prompt + maximum output upfront is matched by the
   charge; the report corrects it to what was used). A rate-limit answer (HTTP 429) cools
   the key down for ``reset_s``: no lease gets it until then.
5. ``release`` and ``report`` of an unknown lease change nothing (idempotent). A report may
   come just after its lease's release (a driver hands completions first): the last
   ``RECENT`` released leases still take their reports.
6. A controller that restarts puts each key's minute and cool-down back (``restore``, from
   ``KeyUsed``): charges by age, relative to the core's ``now``. A lease it grants again
   (``take`` with ``restored``) stays on the key it held and counts in that key's in-flight;
   its charge is the restored one (none once it aged out of the window), never a new one.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

WINDOW_S = 60.0
RECENT = 4096  # released leases whose late reports still count


@dataclass(frozen=True)
class ApiKey:
    """One key of an API as the core knows it: a name and its limits (0: none)."""

    name: str
    rpm: int = 0
    tpm: int = 0
    concurrency: int = 0


@dataclass(slots=True)
class Charge:
    """One granted lease in a key's window."""

    at: float
    units: int
    tokens: int
    live: bool = True  # still inside the window


@dataclass
class KeyState:
    spec: ApiKey
    window: deque[Charge] = field(default_factory=deque)
    in_flight: dict[str, int] = field(default_factory=dict)  # lease -> units
    cool_until: float = 0.0
    requests: int = 0  # in the window
    tokens: int = 0  # in the window
    granted: int = 0  # all time
    limited: int = 0  # rate-limit answers reported, all time

    def roll(self, now: float) -> None:
        while self.window and self.window[0].at <= now - WINDOW_S:
            c = self.window.popleft()
            c.live = False
            self.requests -= c.units
            self.tokens -= c.tokens

    def in_window(self, now: float) -> tuple[int, int]:
        """Requests and tokens in the window at ``now``, without rolling it (a read-only view:
        status may ask at a later time than the core's last event)."""
        requests, tokens = self.requests, self.tokens
        for c in self.window:
            if c.at > now - WINDOW_S:
                break
            requests -= c.units
            tokens -= c.tokens
        return requests, tokens

    def room(self, now: float, units: int, tokens: int) -> bool:
        self.roll(now)
        k = self.spec
        return (
            self.cool_until <= now
            and (k.concurrency <= 0 or len(self.in_flight) < k.concurrency)
            and (k.rpm <= 0 or self.requests + units <= k.rpm)
            and (k.tpm <= 0 or self.tokens + tokens <= k.tpm)
        )

    def used(self) -> float:
        """The largest fraction of any limit in use (rule 3)."""
        k = self.spec
        parts = [
            self.requests / k.rpm if k.rpm > 0 else 0.0,
            self.tokens / k.tpm if k.tpm > 0 else 0.0,
            len(self.in_flight) / k.concurrency if k.concurrency > 0 else 0.0,
        ]
        return max(parts)

    def next_room(self, now: float, units: int, tokens: int) -> float:
        """The earliest time the window and the cool-down give room (in-flight leases free
        on release, which is an event of its own): ``inf`` when nothing in time helps."""
        k = self.spec
        self.roll(now)
        t = max(now, self.cool_until)
        if k.rpm > 0 and self.requests + units > k.rpm:
            t = max(t, self._expiry(self.requests + units - k.rpm, tokens=False))
        if k.tpm > 0 and self.tokens + tokens > k.tpm:
            t = max(t, self._expiry(self.tokens + tokens - k.tpm, tokens=True))
        return t

    def _expiry(self, excess: int, tokens: bool) -> float:
        """When enough of the window has aged out to shed ``excess`` requests (or tokens)."""
        shed = 0
        for c in self.window:
            shed += c.tokens if tokens else c.units
            if shed >= excess:
                return c.at + WINDOW_S
        return math.inf


class KeyPool:
    """The keys of one API (see the module contract)."""

    def __init__(self, keys: tuple[ApiKey, ...]) -> None:
        self.keys = [KeyState(k) for k in keys]
        self._lease_key: dict[str, KeyState] = {}
        self._lease_charge: dict[str, Charge] = {}
        self._released: OrderedDict[str, tuple[KeyState, Charge]] = OrderedDict()
        self._restored: dict[str, tuple[KeyState, Charge]] = {}  # live leases' charges, until granted again

    def __bool__(self) -> bool:
        return bool(self.keys)

    def max_tokens(self) -> int | None:
        """The most tokens one lease can ever be charged (None: no key limits tokens)."""
        if any(k.spec.tpm <= 0 for k in self.keys):
            return None
        return max(k.spec.tpm for k in self.keys)

    def max_units(self) -> int | None:
        if any(k.spec.rpm <= 0 for k in self.keys):
            return None
        return max(k.spec.rpm for k in self.keys)

    def pick(self, now: float, units: int, tokens: int) -> KeyState | None:
        """The key with room and the most headroom, or None."""
        best: tuple[float, int, KeyState] | None = None
        for i, k in enumerate(self.keys):
            if k.room(now, units, tokens) and (best is None or (k.used(), i) < best[:2]):
                best = (k.used(), i, k)
        return None if best is None else best[2]

    def named(self, name: str) -> KeyState | None:
        return next((k for k in self.keys if k.spec.name == name), None)

    def take(
        self, key: KeyState, lease: str, units: int, tokens: int, now: float, restored: bool = False
    ) -> None:
        """Charge ``key`` for a granted lease; ``restored``: granted before a restart (rule 6)."""
        held = self._restored.pop(lease, None) if restored else None
        if held is not None and held[0] is key:
            entry = held[1]
        elif restored:
            entry = Charge(now, units, tokens, live=False)  # its request aged out of the window
        else:
            entry = Charge(now, units, tokens)
            key.window.append(entry)
            key.requests += units
            key.tokens += tokens
        key.in_flight[lease] = units
        key.granted += not restored  # since this controller started
        self._lease_key[lease] = key
        self._lease_charge[lease] = entry

    def restore(
        self, name: str, charges: tuple[tuple[float, int, int, str], ...], cool_left_s: float, now: float
    ) -> bool:
        """Rule 6: key ``name``'s charges ``(age_s, units, tokens, lease)`` and the rest of its
        cool-down, as a restarted controller recorded them; ``lease`` names a live lease that
        will be granted again on this key. False (nothing changes) for a key the pool lacks."""
        key = self.named(name)
        if key is None:
            return False
        added = []
        for age, units, tokens, lease in charges:
            if age >= WINDOW_S or units < 0 or tokens < 0:
                continue
            c = Charge(now - max(0.0, age), units, tokens)
            added.append(c)
            key.requests += units
            key.tokens += tokens
            if lease:
                self._restored[lease] = (key, c)
        key.window = deque(sorted([*key.window, *added], key=lambda c: c.at))
        key.cool_until = max(key.cool_until, now + max(0.0, cool_left_s))
        return True

    def held(self, lease: str) -> tuple[KeyState, Charge] | None:
        """The key a granted (or recently released) lease holds, and its charge."""
        key = self._lease_key.get(lease)
        if key is not None:
            return key, self._lease_charge[lease]
        return self._released.get(lease)

    def next_room(self, now: float, units: int, tokens: int) -> float:
        return min((k.next_room(now, units, tokens) for k in self.keys), default=math.inf)

    def knows(self, lease: str) -> bool:
        return lease in self._lease_key or lease in self._released

    def report(self, lease: str, tokens: int | None, limited: bool, reset_s: float, now: float) -> None:
        """Rule 4: the call's real token use, and a rate-limit answer with its reset time."""
        key = self._lease_key.get(lease)
        entry = self._lease_charge.get(lease)
        if key is None and lease in self._released:
            key, entry = self._released[lease]
        if key is None:
            return
        if tokens is not None and tokens >= 0 and entry is not None and entry.live:
            key.tokens += tokens - entry.tokens
            entry.tokens = tokens
        if limited:
            key.limited += 1
            key.cool_until = max(key.cool_until, now + max(0.0, reset_s))

    def release(self, lease: str) -> None:
        key = self._lease_key.pop(lease, None)
        charge = self._lease_charge.pop(lease, None)
        if key is not None and charge is not None:
            key.in_flight.pop(lease, None)
            self._released[lease] = (key, charge)
            while len(self._released) > RECENT:
                self._released.popitem(last=False)

    def rows(self, now: float) -> list[dict[str, object]]:
        """Per key, what status shows at ``now``: names and counts, never a secret. Read-only."""
        out: list[dict[str, object]] = []
        for k in self.keys:
            requests, tokens = k.in_window(now)
            out.append(
                {
                    "key": k.spec.name,
                    "rpm": k.spec.rpm,
                    "rpm_used": requests,
                    "tpm": k.spec.tpm,
                    "tpm_used": tokens,
                    "concurrency": k.spec.concurrency,
                    "in_flight": len(k.in_flight),
                    "cooling_s": round(max(0.0, k.cool_until - now), 3),
                    "granted": k.granted,
                    "limited": k.limited,
                }
            )
        return out
