"""Task-list overrides rewritten as the user meant them (launcher/config/task_overrides.py)."""

from __future__ import annotations

from launcher.config.task_overrides import one_task, whole_task_lists


def test_a_task_given_key_by_key_is_one_task_and_the_last_value_wins():
    assert one_task(["a=1", "cluster.task.type=worker", "b=2"]) == ["a=1", "cluster.task={type: worker}", "b=2"]
    assert one_task(["cluster.task.index=0", "cluster.task.type=worker", "cluster.task.index=1"]) == [
        "cluster.task={type: worker, index: 1}"]  # as Hydra takes a key given twice
    assert one_task(["cluster.task.index=0,1"]) == ["cluster.task.index=0,1"]  # a sweep: Hydra's own words


def test_a_task_list_given_is_the_whole_list():
    assert whole_task_lists(["cluster.tasks={worker: ['a:1', 'b:1']}"]) == [
        "cluster.tasks={chief: [], ps: [], worker: ['a:1', 'b:1']}"]
