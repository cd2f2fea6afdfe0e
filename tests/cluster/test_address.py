"""Host names, host:port and task lists: what is accepted, and what each refusal says."""

from __future__ import annotations

import pytest

from launcher.cluster.address import TaskListError, host_problem, is_loopback, split_address, tasks_layout


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.1", "::1", "fe80::1%eth0", "localhost", "node-0", "gpu07.cluster.local",
                                  "node0.example.com.", "my_host"])
def test_addresses_and_host_names_are_accepted(host):
    assert host_problem(host) is None


@pytest.mark.parametrize("host,says", [
    ("0.0.0.0", "wildcard"), ("::", "wildcard"), ("10.0.0.1:29500", "cluster.master_port"), ("[::1]", "brackets"),
    ("300.1.1.1", "IPv4"), ("http://node", "URL"), ("a..b", "empty label"), ("-node", "'-node'"), ("", "empty"),
    ("x" * 254, "at most 253"),
])
def test_what_is_not_a_host_is_named(host, says):
    assert says in host_problem(host)


def test_host_port_with_brackets_for_ipv6():
    assert split_address("[::1]:29500") == ("::1", 29500)
    assert split_address("node-1:1") == ("node-1", 1)
    for bad in ("node", "node:0", "node:70000", "node:x", "0.0.0.0:1"):
        with pytest.raises(ValueError):
            split_address(bad)


def test_loopback():
    assert all(map(is_loopback, ["localhost", "127.0.0.1", "127.1.2.3", "::1"]))
    assert not any(map(is_loopback, ["10.0.0.1", "node-0", "::"]))


def test_a_task_list_gives_nodes_master_and_rank():
    tasks = {"chief": ["10.0.0.1:29500"], "worker": ["10.0.0.2:29500", "10.0.0.3:29500"]}
    assert tasks_layout(tasks, {"type": "worker", "index": 1}, None) == {
        "nodes": 3, "master_addr": "10.0.0.1", "master_port": 29500, "node_rank": 2}


def test_a_task_list_with_ps_tasks_gives_their_counts_and_the_chief_as_master():
    tasks = {"chief": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2222", "10.0.0.3:2222"], "ps": ["10.0.0.4:2222"]}
    assert tasks_layout(tasks, {"type": "ps", "index": 0}, None) == {
        "workers": 2, "ps": 1, "master_addr": "10.0.0.1", "master_port": 2222}


@pytest.mark.parametrize("tasks,task,key,says", [
    ({"evaluator": ["a:1"]}, None, "cluster.tasks", "unknown role 'evaluator'"),
    ({"ps": ["a:1"]}, None, "cluster.tasks", "needs exactly one chief"),
    ({"chief": ["127.0.0.1:1"], "ps": ["10.0.0.2:1"]}, None, "cluster.tasks", "chief hosts the RPC rendezvous on loopback"),
    ({"chief": ["a:1", "b:1"]}, None, "cluster.tasks", "one chief"),
    ({"chief": [], "worker": []}, None, "cluster.tasks", "no node"),
    ({"chief": ["a:1"], "worker": ["b"]}, None, "cluster.tasks", "'b' is not host:port"),
    ({"chief": ["127.0.0.1:1"], "worker": ["10.0.0.2:1"]}, None, "cluster.tasks", "10.0.0.2 cannot reach"),
    ({"chief": ["a:1"]}, {"type": "worker", "index": 0}, "cluster.task", "worker:0 is not in cluster.tasks"),
])
def test_a_wrong_task_list_names_its_key(tasks, task, key, says):
    with pytest.raises(TaskListError) as info:
        tasks_layout(tasks, task, None)
    assert info.value.key == key and says in info.value.message


def test_wrong_types_are_left_to_pydantic():
    assert tasks_layout(5, None, None) == {}
    assert tasks_layout({"chief": [5]}, None, None) == {}
    assert "node_rank" not in tasks_layout({"chief": ["a:1"]}, {"type": ["chief"], "index": 0}, None)
