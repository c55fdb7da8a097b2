"""Staleness bounded at admission (trainer.async_rollout.on_stale=wait), as a pure schedule
(docs/trainer.md, "Staleness bound, at admission"). Every weight version trains `per_version` prompt
groups; a group admitted at head version h must train by its deadline h + max_staleness. A group is
admitted, or taken by the trainer, only if afterwards every admitted, untrained group can still get
a slot by its deadline (earliest-deadline-first is then feasible), so none goes stale and none is
dropped for its length."""

from __future__ import annotations

from collections import Counter


class AdmissionSchedule:
    """Deadlines of the admitted, untrained groups against the trainer's remaining slots."""

    def __init__(self, per_version: int, max_staleness: int, version: int = 0) -> None:
        if per_version < 1 or max_staleness < 0:
            raise ValueError(f"per_version={per_version} (>= 1), max_staleness={max_staleness} (>= 0)")
        self.per_version = per_version
        self.max_staleness = max_staleness
        self.version = version  # the version the trainer is taking groups for
        self.slots_left = per_version  # groups it still takes at `version`
        self.due: Counter[int] = Counter()  # deadline version -> untrained groups

    def deadline(self, head: int) -> int:
        """The last version a group whose generation started at `head` may train at."""
        return head + self.max_staleness

    def _feasible(self, due: Counter[int], slots_left: int) -> bool:
        placed = 0
        for deadline in sorted(d for d in due if due[d]):
            placed += due[deadline]
            if placed > slots_left + (deadline - self.version) * self.per_version:
                return False
        return True

    def can_admit(self, head: int) -> bool:
        """Whether a group may start generating at `head` without any group going stale."""
        return self._feasible(self.due + Counter({self.deadline(head): 1}), self.slots_left)

    def admit(self, head: int) -> None:
        """A group starts generating at `head` (the caller checked can_admit)."""
        self.due[self.deadline(head)] += 1

    def release(self, head: int) -> None:
        """An admitted group will never be trained (it failed or was cancelled)."""
        self.due[self.deadline(head)] -= 1
        if self.due[self.deadline(head)] < 0:
            raise ValueError(f"released a group of head {head} that was never admitted")

    def can_take(self, head: int) -> bool:
        """Whether the trainer may train a finished group of `head` now: one slot is left at
        this version and every other untrained group still fits by its deadline."""
        if self.slots_left < 1 or self.due[self.deadline(head)] < 1:
            return False
        return self._feasible(self.due - Counter({self.deadline(head): 1}), self.slots_left - 1)

    def take(self, head: int) -> None:
        """The trainer trains a group of `head` at `version` (the caller checked can_take)."""
        self.due[self.deadline(head)] -= 1
        self.slots_left -= 1

    def untake(self, head: int) -> None:
        """Undo take() (a cancelled take gives its groups back)."""
        self.due[self.deadline(head)] += 1
        self.slots_left += 1

    def advance(self, version: int) -> None:
        """The trainer moves on to `version`; it must have taken every slot of the last one."""
        if version == self.version:
            return
        if version != self.version + 1 or self.slots_left:
            raise ValueError(f"the trainer moved from version {self.version} to {version} with "
                             f"{self.slots_left} of its {self.per_version} groups untaken: the "
                             "admission bound counts on per_version groups per version")
        self.version, self.slots_left = version, self.per_version
