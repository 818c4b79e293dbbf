"""VaLoRA's accuracy-aware adapter generation (§4.2.1): the fewest adapters such that every task meets its
accuracy floor, found greedily with rollback. Pure: training and evaluation are the caller's `Trainer`
(the `tessera fuse` command trains with transformers + PEFT), and the journal is a list the caller persists.

`fuse` takes the tasks in the given order. The open adapter holds some tasks; it is trained on the next
one and every task it then holds is evaluated. All at or above their floors: the new state is kept.
Otherwise it is rolled back to its last good state and closed, and a fresh adapter starts with the task
that broke it. A task that misses its floor even alone on a fresh adapter is kept there alone anyway, that
adapter closed, and the result names it in `misses`: the run never retries. Running example, where `c`
hurts `a`:
    started 0, trained a on 0, kept a on 0, trained b on 0, kept b on 0,
    trained c on 0, rolled_back c on 0 (a below)   -> adapter 0 = {a, b} at its state after b
    started 1, trained c on 1, kept c on 1         -> adapter 1 = {c}

Resume: every decision is appended to the journal as a JSON-ready dict the moment it is made, so a caller
can hand `fuse` a list subclass whose `append` writes each record through. Given the journal of an
interrupted run and the same inputs, the run replays the recorded decisions (trusting their states and
accuracies, so no finished training runs again) and continues after the last one. A recorded decision this
run would not make (other tasks, another order, other floors) is refused with a ValueError naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar, get_args

S = TypeVar("S")  # an adapter's state: an opaque handle, e.g. a checkpoint path; a JSON value, for the journal

Kind = Literal["started", "trained", "kept", "rolled_back"]
Record = dict[str, Any]  # a decision as the journal holds it


class Trainer(Protocol[S]):
    def start(self) -> S:
        """A fresh adapter."""

    def train(self, state: S, task: str) -> S:
        """A new state: the adapter at `state` after training on `task`'s data (`state` stays as it was)."""

    def evaluate(self, state: S, task: str) -> float:
        """`task`'s metric on its eval set at `state`, in [0, 1]."""


@dataclass(frozen=True)
class Decision(Generic[S]):
    kind: Kind
    adapter: int                      # the adapter's index, in the order adapters started
    task: str | None = None           # the task trained last (None: started)
    state: S | None = None            # started, trained: the adapter's new state
    accuracy: Mapping[str, float] = field(default_factory=dict)  # kept, rolled_back: each task it holds
    below: tuple[str, ...] = ()       # kept, rolled_back: the tasks under their floors

    def record(self) -> Record:
        return {"kind": self.kind, "adapter": self.adapter, "task": self.task, "state": self.state,
                "accuracy": dict(self.accuracy), "below": list(self.below)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any], at: int) -> Decision[Any]:
        try:
            kind, adapter, task = record["kind"], record["adapter"], record["task"]
            decision: Decision[Any] = cls(kind, adapter, task, record["state"],
                                          {str(t): float(a) for t, a in record["accuracy"].items()},
                                          tuple(record["below"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"journal record {at} is malformed: {record!r}") from e
        if kind not in get_args(Kind) or not isinstance(adapter, int) or not (task is None or isinstance(task, str)):
            raise ValueError(f"journal record {at} is malformed: {record!r}")
        return decision

    def __str__(self) -> str:
        what = self.kind if self.task is None else f"{self.kind} {self.task!r}"
        return f"{what} on adapter {self.adapter}" + (f" (below: {', '.join(self.below)})" if self.below else "")


@dataclass(frozen=True)
class FusedAdapter(Generic[S]):
    tasks: tuple[str, ...]
    state: S                          # its last good state (the one kept, never a rolled-back one)
    accuracy: Mapping[str, float]     # each task's metric at `state`
    misses: tuple[str, ...] = ()      # its tasks under their floors (a task alone, or the all-in-one baseline)


@dataclass(frozen=True)
class FusionResult(Generic[S]):
    adapters: tuple[FusedAdapter[S], ...]
    decisions: tuple[Decision[S], ...]  # every decision, replayed ones included, in order

    @property
    def misses(self) -> tuple[str, ...]:
        """The tasks under their floors, whatever the adapter."""
        return tuple(t for a in self.adapters for t in a.misses)


@dataclass(frozen=True)
class _Open(Generic[S]):
    index: int
    tasks: tuple[str, ...]
    state: S
    accuracy: Mapping[str, float]
    misses: tuple[str, ...]

    def closed(self) -> FusedAdapter[S]:
        return FusedAdapter(self.tasks, self.state, self.accuracy, self.misses)


class _Run(Generic[S]):
    """One run's steps: each replays the journal's next record if there is one, else does the work and
    appends its record."""

    def __init__(self, tasks: Sequence[str], floors: Mapping[str, float], trainer: Trainer[S],
                 journal: list[Record] | None) -> None:
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"tasks repeat: {list(tasks)}")
        for task in tasks:
            if task not in floors or not 0.0 <= floors[task] <= 1.0:
                raise ValueError(f"task {task!r} needs a floor in [0, 1], has {floors.get(task)!r}")
        self._floors = floors
        self._trainer = trainer
        self._journal: list[Record] = [] if journal is None else journal
        self._replayed = 0
        self.decisions: list[Decision[S]] = []

    def start(self, index: int) -> S:
        return self._step("started", index, None, self._trainer.start)

    def train(self, index: int, state: S, task: str) -> S:
        return self._step("trained", index, task, lambda: self._trainer.train(state, task))

    def judge(self, index: int, tasks: tuple[str, ...], state: S, final: bool) -> Decision[S]:
        """Evaluates every task the adapter holds at `state` (trained last on `tasks[-1]`): kept, or rolled
        back when one is under its floor. `final`: kept even then."""
        task = tasks[-1]
        recorded = self._next()
        if recorded is None:
            accuracy = {t: self._trainer.evaluate(state, t) for t in tasks}
        elif recorded.kind in ("kept", "rolled_back") and (recorded.adapter, recorded.task) == (index, task) \
                and tuple(recorded.accuracy) == tasks:
            accuracy = dict(recorded.accuracy)
        else:
            raise self._mismatch(recorded, f"an evaluation of {', '.join(tasks)} on adapter {index}")
        assert all(0.0 <= a <= 1.0 for a in accuracy.values()), f"accuracy outside [0, 1]: {accuracy}"
        below = tuple(t for t in tasks if accuracy[t] < self._floors[t])
        verdict: Decision[S] = Decision("kept" if final or not below else "rolled_back", index, task,
                                        accuracy=accuracy, below=below)
        if recorded is not None and (recorded.kind, recorded.below) != (verdict.kind, verdict.below):
            raise self._mismatch(recorded, f"'{verdict}' with these floors")
        self._done(verdict, recorded is not None)
        return verdict

    def fresh(self, index: int, task: str) -> _Open[S]:
        """A fresh adapter trained on `task` alone, kept whether or not it meets its floor."""
        state = self.train(index, self.start(index), task)
        verdict = self.judge(index, (task,), state, final=True)
        return _Open(index, (task,), state, verdict.accuracy, verdict.below)

    def extend(self, adapter: _Open[S], task: str) -> _Open[S] | None:
        """`adapter` trained on `task` too if every task it then holds meets its floor, else None."""
        tasks = adapter.tasks + (task,)
        state = self.train(adapter.index, adapter.state, task)
        verdict = self.judge(adapter.index, tasks, state, final=False)
        return _Open(adapter.index, tasks, state, verdict.accuracy, ()) if verdict.kind == "kept" else None

    def finish(self, adapters: list[FusedAdapter[S]]) -> FusionResult[S]:
        left = self._next()
        if left is not None:
            raise self._mismatch(left, "its end")
        return FusionResult(tuple(adapters), tuple(self.decisions))

    def _step(self, kind: Kind, index: int, task: str | None, make: Callable[[], S]) -> S:
        """A started or trained step: its new state, recorded, or made by `make()` and recorded now."""
        recorded = self._next()
        if recorded is None:
            decision: Decision[S] = Decision(kind, index, task, make())
        elif (recorded.kind, recorded.adapter, recorded.task) == (kind, index, task):
            decision = recorded
        else:
            raise self._mismatch(recorded, f"'{Decision(kind, index, task)}'")
        self._done(decision, recorded is not None)
        assert decision.state is not None, f"{decision} without a state"
        return decision.state

    def _next(self) -> Decision[S] | None:
        if self._replayed == len(self._journal):
            return None
        return Decision.from_record(self._journal[self._replayed], self._replayed)

    def _done(self, decision: Decision[S], replayed: bool) -> None:
        if not replayed:
            self._journal.append(decision.record())
        self._replayed += 1
        self.decisions.append(decision)

    def _mismatch(self, recorded: Decision[S], expected: str) -> ValueError:
        return ValueError(f"journal record {self._replayed} is '{recorded}' where this run's next step is "
                          f"{expected}: the journal is of other tasks, another order or other floors")


def fuse(tasks: Sequence[str], floors: Mapping[str, float], trainer: Trainer[S],
         journal: list[Record] | None = None) -> FusionResult[S]:
    """VaLoRA's greedy with rollback over `tasks` in order (see the module's docstring)."""
    run = _Run(tasks, floors, trainer, journal)
    closed: list[FusedAdapter[S]] = []
    current: _Open[S] | None = None
    for task in tasks:
        if current is not None:
            grown = run.extend(current, task)
            if grown is not None:
                current = grown
                continue
            closed.append(current.closed())  # rolled back: its last good state
        current = run.fresh(len(closed), task)
        if current.misses:  # no task can join an adapter whose own task misses already
            closed.append(current.closed())
            current = None
    if current is not None:
        closed.append(current.closed())
    return run.finish(closed)


def one_per_task(tasks: Sequence[str], floors: Mapping[str, float], trainer: Trainer[S],
                 journal: list[Record] | None = None) -> FusionResult[S]:
    """The baseline of one adapter per task (VaLoRA's "one per small model")."""
    run = _Run(tasks, floors, trainer, journal)
    return run.finish([run.fresh(i, task).closed() for i, task in enumerate(tasks)])


def all_in_one(tasks: Sequence[str], floors: Mapping[str, float], trainer: Trainer[S],
               journal: list[Record] | None = None) -> FusionResult[S]:
    """The baseline of one adapter trained on every task in order, judged once at the end."""
    run = _Run(tasks, floors, trainer, journal)
    if not tasks:
        return run.finish([])
    state = run.start(0)
    for task in tasks:
        state = run.train(0, state, task)
    verdict = run.judge(0, tuple(tasks), state, final=True)
    return run.finish([FusedAdapter(tuple(tasks), state, verdict.accuracy, verdict.below)])
