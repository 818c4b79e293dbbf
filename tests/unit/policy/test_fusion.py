"""VaLoRA's greedy adapter fusion (policy/fusion.py) with a fake trainer: a state is the tuple of tasks
trained, and a task's accuracy is its accuracy alone less what each other task trained with it costs it,
so each test sets the interference it needs."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping

import pytest

from policy.fusion import FusedAdapter, all_in_one, fuse, one_per_task

FLOOR = 0.8


class FakeTrainer:
    def __init__(self, alone: Mapping[str, float], hurts: Mapping[tuple[str, str], float] = {}) -> None:
        self.alone = alone    # task -> its accuracy trained alone
        self.hurts = hurts    # (task, other) -> what `other` trained on the same adapter costs `task`
        self.trained: list[tuple[tuple[str, ...], str]] = []  # every train() call: (state, task)

    def start(self) -> tuple[str, ...]:
        return ()

    def train(self, state: tuple[str, ...], task: str) -> tuple[str, ...]:
        self.trained.append((tuple(state), task))
        return tuple(state) + (task,)

    def evaluate(self, state: tuple[str, ...], task: str) -> float:
        if task not in state:
            return 0.0
        return max(0.0, self.alone[task] - sum(self.hurts.get((task, other), 0.0) for other in state if other != task))


def floors(tasks: str) -> dict[str, float]:
    return {t: FLOOR for t in tasks}


def tasks_of(adapters: tuple[FusedAdapter[tuple[str, ...]], ...]) -> list[str]:
    return ["".join(a.tasks) for a in adapters]


def test_tasks_that_do_not_interfere_fuse_into_one_adapter() -> None:
    # Some interference, none below a floor (values exact in binary, so accuracies compare exactly).
    trainer = FakeTrainer({"a": 1.0, "b": 0.875, "c": 0.875}, {("a", "b"): 0.125, ("c", "a"): 0.0625})
    result = fuse("abc", floors("abc"), trainer)
    (adapter,) = result.adapters
    assert adapter == FusedAdapter(("a", "b", "c"), ("a", "b", "c"), {"a": 0.875, "b": 0.875, "c": 0.8125})
    assert result.misses == ()
    assert [str(d) for d in result.decisions] == [
        "started on adapter 0", "trained 'a' on adapter 0", "kept 'a' on adapter 0",
        "trained 'b' on adapter 0", "kept 'b' on adapter 0", "trained 'c' on adapter 0", "kept 'c' on adapter 0"]
    assert len(trainer.trained) == 3


def test_a_task_breaking_an_older_ones_floor_rolls_back_and_starts_a_new_adapter() -> None:
    trainer = FakeTrainer({"a": 0.9, "b": 0.9, "c": 0.9}, {("a", "c"): 0.3})
    result = fuse("abc", floors("abc"), trainer)
    old, new = result.adapters
    # The old adapter keeps its last good state (after b), never the state c broke.
    assert old == FusedAdapter(("a", "b"), ("a", "b"), {"a": 0.9, "b": 0.9})
    assert new == FusedAdapter(("c",), ("c",), {"c": 0.9})
    assert [str(d) for d in result.decisions[5:]] == [
        "trained 'c' on adapter 0", "rolled_back 'c' on adapter 0 (below: a)",
        "started on adapter 1", "trained 'c' on adapter 1", "kept 'c' on adapter 1"]
    assert result.decisions[6].accuracy == {"a": pytest.approx(0.6), "b": 0.9, "c": 0.9}
    assert trainer.trained[-1] == ((), "c")  # c is trained on a fresh adapter, not on the rolled-back one


def test_a_new_task_that_falls_below_its_own_floor_also_rolls_back() -> None:
    trainer = FakeTrainer({"a": 0.9, "b": 0.9}, {("b", "a"): 0.2})
    assert tasks_of(fuse("ab", floors("ab"), trainer).adapters) == ["a", "b"]


def test_the_order_of_tasks_changes_how_many_adapters_the_greedy_makes() -> None:
    # a clashes with c, b with d: a, b, c, d makes {a, b} then {c, d}; a, c, b, d leaves b and d apart.
    clashes = {("a", "c"): 0.3, ("c", "a"): 0.3, ("b", "d"): 0.3, ("d", "b"): 0.3}
    trainer = FakeTrainer(dict.fromkeys("abcd", 0.9), clashes)
    assert tasks_of(fuse("abcd", floors("abcd"), trainer).adapters) == ["ab", "cd"]
    assert tasks_of(fuse("acbd", floors("abcd"), trainer).adapters) == ["a", "cb", "d"]


def test_tasks_that_all_clash_get_one_adapter_each_as_the_baseline_does() -> None:
    clashes = {(x, y): 0.2 for x in "abcd" for y in "abcd" if x != y}
    trainer = FakeTrainer(dict.fromkeys("abcd", 0.9), clashes)
    result = fuse("abcd", floors("abcd"), trainer)
    assert tasks_of(result.adapters) == ["a", "b", "c", "d"]
    assert [a.state for a in result.adapters] == [("a",), ("b",), ("c",), ("d",)]
    assert result.adapters == one_per_task("abcd", floors("abcd"), trainer).adapters
    assert result.misses == ()


def test_a_task_missing_its_floor_even_alone_is_kept_alone_and_reported_never_retried() -> None:
    trainer = FakeTrainer({"a": 0.9, "x": 0.5, "b": 0.9})
    result = fuse("axb", floors("axb"), trainer)
    assert tasks_of(result.adapters) == ["a", "x", "b"]
    assert result.adapters[1] == FusedAdapter(("x",), ("x",), {"x": 0.5}, misses=("x",))
    assert result.misses == ("x",)
    assert str(result.decisions[-4]) == "kept 'x' on adapter 1 (below: x)"
    # x tried on a's adapter, then alone; b never joins the adapter whose own task misses.
    assert trainer.trained == [((), "a"), (("a",), "x"), ((), "x"), ((), "b")]


def test_the_baselines_one_adapter_per_task_and_one_for_all() -> None:
    trainer = FakeTrainer({"a": 0.9, "b": 0.9, "c": 0.9}, {("a", "c"): 0.3})
    per_task = one_per_task("abc", floors("abc"), trainer)
    assert tasks_of(per_task.adapters) == ["a", "b", "c"] and per_task.misses == ()
    trainer.trained.clear()
    everything = all_in_one("abc", floors("abc"), trainer)
    assert everything.adapters == (FusedAdapter(("a", "b", "c"), ("a", "b", "c"),
                                                 {"a": pytest.approx(0.6), "b": 0.9, "c": 0.9}, misses=("a",)),)
    assert trainer.trained == [((), "a"), (("a",), "b"), (("a", "b"), "c")]  # judged once, at the end
    assert [d.kind for d in everything.decisions] == ["started", "trained", "trained", "trained", "kept"]


def rollback_and_miss() -> tuple[str, dict[str, float], FakeTrainer]:
    """Every kind of decision: a fusion, a rollback, a task missing alone, an adapter after it."""
    return "abxcd", floors("abxcd"), FakeTrainer({"a": 0.9, "b": 0.9, "x": 0.5, "c": 0.9, "d": 0.9},
                                                  {("a", "c"): 0.3})


def test_a_run_resumed_after_any_decision_ends_as_an_uninterrupted_one_without_training_again() -> None:
    tasks, task_floors, trainer = rollback_and_miss()
    journal: list[dict] = []
    whole = fuse(tasks, task_floors, trainer, journal)
    assert journal == [d.record() for d in whole.decisions]
    json.dumps(journal)  # JSON-ready, for the caller to persist
    assert {d.kind for d in whole.decisions} == {"started", "trained", "kept", "rolled_back"}
    for cut in range(len(journal) + 1):
        resumed_trainer = rollback_and_miss()[2]
        resumed_journal = copy.deepcopy(journal[:cut])
        resumed = fuse(tasks, task_floors, resumed_trainer, resumed_journal)
        assert resumed == whole, cut
        assert resumed_journal == journal
        trained_before = sum(r["kind"] == "trained" for r in journal[:cut])
        assert resumed_trainer.trained == trainer.trained[trained_before:], cut


def test_a_journal_read_back_from_json_resumes() -> None:
    tasks, task_floors, trainer = rollback_and_miss()
    journal: list[dict] = []
    whole = fuse(tasks, task_floors, trainer, journal)
    resumed_trainer = rollback_and_miss()[2]
    resumed = fuse(tasks, task_floors, resumed_trainer, json.loads(json.dumps(journal[:9])))
    assert [(a.tasks, tuple(a.state), a.accuracy, a.misses) for a in resumed.adapters] == \
        [(a.tasks, a.state, a.accuracy, a.misses) for a in whole.adapters]
    assert len(resumed_trainer.trained) == len(trainer.trained) - 4


@pytest.mark.parametrize(("tasks", "task_floors", "message"), [
    ("acb", floors("abc"), "journal record 3 is 'trained 'b' on adapter 0' where this run's next step is "
                           "'trained 'c' on adapter 0'"),
    ("abd", floors("abd"), "journal record 5 is 'trained 'c' on adapter 0' where this run's next step is "
                           "'trained 'd' on adapter 0'"),
    ("ab", floors("ab"), "journal record 5 is 'trained 'c' on adapter 0' where this run's next step is its end"),
    ("abc", {**floors("abc"), "a": 0.5}, "journal record 6 is 'rolled_back 'c' on adapter 0 (below: a)' where "
                                         "this run's next step is 'kept 'c' on adapter 0' with these floors"),
])
def test_a_journal_of_other_tasks_order_or_floors_is_refused_naming_the_first_mismatch(
        tasks: str, task_floors: dict[str, float], message: str) -> None:
    trainer = FakeTrainer(dict.fromkeys("abcd", 0.9), {("a", "c"): 0.3})
    journal: list[dict] = []
    fuse("abc", floors("abc"), trainer, journal)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fuse(tasks, task_floors, trainer, copy.deepcopy(journal))


def test_a_malformed_journal_record_is_refused() -> None:
    trainer = FakeTrainer({"a": 0.9})
    with pytest.raises(ValueError, match="journal record 0 is malformed"):
        fuse("a", floors("a"), trainer, [{"kind": "started"}])
    with pytest.raises(ValueError, match="journal record 0 is malformed"):
        fuse("a", floors("a"), trainer, [{"kind": "merged", "adapter": 0, "task": None, "state": [],
                                          "accuracy": {}, "below": []}])


def test_tasks_need_distinct_names_and_a_floor_each() -> None:
    trainer = FakeTrainer({"a": 0.9})
    with pytest.raises(ValueError, match="tasks repeat"):
        fuse("aa", floors("a"), trainer)
    with pytest.raises(ValueError, match="task 'b' needs a floor"):
        fuse("ab", floors("a"), trainer)
    with pytest.raises(ValueError, match="task 'a' needs a floor"):
        all_in_one("a", {"a": 1.5}, trainer)
