"""launcher/config/shapes.py: the ``cluster=NxM`` options a command can choose."""

from __future__ import annotations

from launcher.config import shapes


def test_shapes_come_from_the_overrides_and_from_a_primary_configs_defaults(tmp_path):
    (tmp_path / "myrun.yaml").write_text("defaults:\n  - config\n  - override cluster: 2x4\n  - override /strategy: mirrored\n"
                                         "  - _self_\n")
    (tmp_path / "other.yaml").write_text("defaults:\n  - override cluster: 8x8\n")
    found = shapes.named(["cluster=1x2,4x1", "trainer.steps=3"], [str(tmp_path)], "myrun")
    assert found == {"1x1", "1x2", "4x1", "2x4"}  # other.yaml is not the primary config
    assert shapes.named([], [str(tmp_path)], "myrun.yaml") == {"1x1", "2x4"}  # --config-name myrun.yaml
    (tmp_path / "myrun.yaml").write_text("defaults: [oops\n")  # Hydra reports the file; the shapes skip it
    assert shapes.named([], [str(tmp_path)], "myrun") == {"1x1"}


def test_a_shape_is_the_cluster_section_with_its_nodes_and_devices():
    assert shapes.node("2x8", {"nodes": 1, "devices_per_node": 1, "device": "auto"}) == {
        "nodes": 2, "devices_per_node": 8, "device": "auto"}


def test_a_shape_spelled_another_way_gets_the_one_meant():
    """`cluster=1X2` got no did-you-mean, where `strategy=mirored` gets one."""
    from launcher.config.compose import _check_choice

    for typed, meant in (("1X2", "1x2"), ("2*8", "2x8"), ("2 x 8", "2x8"), ("0x1", None), ("0X2", None), ("1X0", None), ("x", None)):
        problem = _check_choice("cluster", typed)
        assert problem is not None and problem.suggestion == meant, typed
    assert _check_choice("cluster", "1x2") is None
