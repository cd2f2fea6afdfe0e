"""Topology and DeviceAssignment: replicas of logical devices over ranks, and the arithmetic when they do not fit."""

from __future__ import annotations

import re

import pytest

from launcher.distribute.device_assignment import DeviceAssignment, Topology


def test_two_logical_devices_by_four_replicas_over_eight_devices():
    a = DeviceAssignment.build(Topology.from_devices(8), computation_shape=[1, 1, 1, 2], num_replicas=4)
    assert (a.num_replicas, a.num_cores_per_replica) == (4, 2)
    assert [a.rank(r, c) for r in range(4) for c in range(2)] == list(range(8))  # a replica's devices are neighbours
    assert a.position(5) == (2, 1)
    assert a.coordinates(3, 1) == [0, 0, 0, 7]
    assert a.lookup_replicas(task_id=6, logical_core=0) == [3]
    assert len(a.core_assignment) == 4 and len(a.core_assignment[0]) == 2


def test_eight_logical_devices_in_one_replica():
    a = DeviceAssignment.build(8, computation_shape=[1, 2, 2, 2], num_replicas=1)
    assert a.num_cores_per_replica == 8 and a.tpu_ordinal(0, 7) == 7


@pytest.mark.parametrize("shape,replicas,devices,says", [
    ([1, 1, 1, 2], 2, 2, "computation_shape [1, 1, 1, 2] x num_replicas 2 = 4 devices, but the topology has 2"),
    ([1, 0, 1, 2], 1, 2, "sizes >= 1"),
    ([1, 1, 1, 2], 0, 2, "num_replicas must be >= 1"),
])
def test_a_device_assignment_that_does_not_fit_shows_the_arithmetic(shape, replicas, devices, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        DeviceAssignment.build(Topology.from_devices(devices), shape, num_replicas=replicas)


def test_out_of_range_replicas_and_cores_are_value_errors():
    a = DeviceAssignment.build(4, [1, 1, 1, 2], num_replicas=2)
    with pytest.raises(ValueError, match="replica 2 is out of range"):
        a.rank(2, 0)
    with pytest.raises(ValueError, match="logical core 2 is out of range"):
        a.rank(0, 2)
