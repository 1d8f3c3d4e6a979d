"""``DataParallelEngine``'s sleep mode, mixed into it: ``sleep(level)``, ``wake_up(tags)`` and ``is_sleeping`` run
``Engine``'s on every replica process (each built with ``enable_sleep_mode=True``; a ``SLEEP`` command, answered
with the replica's status). A replica that cannot is named; on ``sleep`` the replicas that slept wake again, so
the front is either asleep on every replica or on none. Not with ``dp_attention`` (its replicas step in lock
step, which sleep would have to pause on every one at once).

What they use of the front: ``_replicas``, ``_send_to``, ``_collect``, ``_check_usable``, ``_num_unfinished``,
``dp_attention`` and ``_asleep`` (the tags asleep on every replica).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable

from atom_core.engine.dp_replica import SLEEP
from atom_core.engine.sleep_mode import SLEEP_LEVELS, WAKE_TAGS, EngineAsleepError, wake_tags

__all__ = ["ReplicaSleepMode"]


class ReplicaSleepMode:
    """The sleep-mode methods of ``DataParallelEngine`` (see the module docstring)."""

    _asleep: frozenset[str] = frozenset()

    @property
    def is_sleeping(self) -> bool:
        """Whether ``sleep`` took something from the replicas that ``wake_up`` has not brought back yet."""
        return bool(self._asleep)

    def sleep(self, level: int = 1) -> None:
        """``Engine.sleep(level)`` on every replica (see there). Refused, changing nothing: a level other than 1 or 2
        (ValueError), unfinished requests (RuntimeError naming the count), ``dp_attention`` (NotImplementedError). A
        replica that cannot sleep (sleep mode off: RuntimeError naming it) leaves every replica awake."""
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise ValueError(f"DataParallelEngine.sleep: level must be 1 or 2, got {level!r}")
        if self.dp_attention:
            raise NotImplementedError("DataParallelEngine.sleep: not built with dp_attention (the replicas step in "
                                      "lock step)")
        if self._asleep:
            return  # (each replica would log that it is asleep already)
        unfinished = self._num_unfinished()
        if unfinished:
            raise RuntimeError(f"DataParallelEngine.sleep: {unfinished} requests are unfinished; their KV would be "
                               "freed: let them finish (or abort them) first")
        failed = self._on_every_replica({"sleep": level})
        if failed:
            self._on_every_replica({"wake": list(WAKE_TAGS)})  # (a replica that did not sleep does nothing)
            raise RuntimeError(f"DataParallelEngine.sleep: {failed}; every replica is awake again")
        self._asleep = frozenset(WAKE_TAGS)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """``Engine.wake_up(tags)`` on every replica (see there); a replica that could not is named, and calling
        ``wake_up`` again with the same tags retries it (replicas already awake do nothing)."""
        tags = wake_tags(tags)
        if not self._asleep:
            return
        failed = self._on_every_replica({"wake": sorted(tags)})
        if failed:
            raise RuntimeError(f"DataParallelEngine.wake_up: {failed}; call wake_up({sorted(tags)!r}) again")
        self._asleep = self._asleep - tags

    def _check_awake(self, caller: str) -> None:
        """``EngineAsleepError`` naming what is asleep on the replicas (``Engine._check_awake``'s rule)."""
        if self._asleep:
            raise EngineAsleepError(f"{caller}: the replicas are asleep ({sorted(self._asleep)} asleep): wake_up() "
                                    "first")

    def _on_every_replica(self, message: dict) -> str:
        """Send one ``SLEEP`` command to every replica and wait for all; "" when each did its part, else which
        failed and why."""
        self._check_usable()
        indices = range(len(self._replicas))
        self._send_to(indices, pickle.dumps((SLEEP, message)))
        answers = self._collect((SLEEP,), indices)
        return "; ".join(f"replica {i}: {answers[i][1]}" for i in indices if answers[i][1])
