"""File-backed datasets (launcher.input.files): formats round-trip, globs resolve, batches come out in order."""

import json

import numpy as np
import pytest
import torch

from launcher.input.auto_shard import AutoShardPolicy, ShardPlan
from launcher.input.files import (
    FieldWidth,
    FileDataset,
    MissingFields,
    count_rows,
    field_width,
    infer_format,
    read_columns,
    read_file,
    resolve_files,
    write_file,
    write_shards,
)

FORMATS = ["jsonl", "csv", "pt", "npy"]


def columns(n=6, start=0):
    ids = torch.arange(start, start + n)
    return {"x": torch.stack([ids * 1.5, ids * -0.25, ids + 0.125], dim=1), "y": (ids * 2.0).unsqueeze(1), "id": ids.float()}


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_round_trips(tmp_path, fmt):
    cols = columns()
    path = write_file(tmp_path / f"part.{fmt}", cols)
    back = read_file(path, fmt)
    assert list(back) == ["x", "y", "id"]
    for key in cols:
        assert back[key].shape == cols[key].shape, key
        torch.testing.assert_close(back[key].float(), cols[key], rtol=0, atol=0)
    assert count_rows(path, fmt) == 6


def test_jsonl_keeps_integer_fields_integer(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"label": 3, "x": [0.5, 1.0]}\n\n{"label": 4, "x": [1.5, 2.0]}\n')
    cols = read_file(path, "jsonl")
    assert cols["label"].dtype == torch.int64 and cols["label"].tolist() == [3, 4]
    assert cols["x"].dtype == torch.float32 and cols["x"].shape == (2, 2)
    assert count_rows(path, "jsonl") == 2


def test_jsonl_lines_must_share_fields(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"x": 1}) + "\n" + json.dumps({"y": 1}) + "\n")
    with pytest.raises(ValueError, match=r"a.jsonl:2"):
        read_file(path, "jsonl")


def test_csv_columns_become_float_fields_and_dotted_columns_a_vector(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("x.1,x.0,label\n2,1,0\n4,3,1\n")
    cols = read_file(path, "csv")
    assert cols["x"].tolist() == [[1.0, 2.0], [3.0, 4.0]]  # ordered by the index after the dot
    assert cols["label"].dtype == torch.float32 and cols["label"].tolist() == [0.0, 1.0]
    assert count_rows(path, "csv") == 2


def test_pt_files_are_loaded_without_running_code(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"x": torch.zeros(2), "hook": _NotATensor()}, path)
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        read_file(path, "pt")


class _NotATensor:
    pass


def test_pt_must_hold_a_dict_of_tensors(tmp_path):
    path = tmp_path / "list.pt"
    torch.save([torch.zeros(2)], path)
    with pytest.raises(ValueError, match="dict of tensors"):
        read_file(path, "pt")


def test_plain_npy_array_is_the_field_data(tmp_path):
    path = tmp_path / "a.npy"
    np.save(path, np.arange(12, dtype=np.float32).reshape(4, 3))
    cols = read_file(path, "npy")
    assert list(cols) == ["data"] and cols["data"].shape == (4, 3)
    assert count_rows(path, "npy") == 4


def test_fields_need_one_row_per_element(tmp_path):
    with pytest.raises(ValueError, match="one row per element"):
        write_file(tmp_path / "a.pt", {"x": torch.zeros(3), "y": torch.zeros(2)})


def test_resolve_files_sorts_each_pattern_and_keeps_pattern_order(tmp_path):
    for name in ("b-2.jsonl", "b-1.jsonl", "a-1.jsonl"):
        (tmp_path / name).write_text("")
    found = resolve_files(["b-*.jsonl", "a-*.jsonl", "b-1.jsonl"], root=tmp_path)
    assert [p.rsplit("/", 1)[1] for p in found] == ["b-1.jsonl", "b-2.jsonl", "a-1.jsonl"]
    assert resolve_files(found) == found  # resolving resolved paths changes nothing (workers re-validate)


def test_resolve_files_with_no_match_names_the_pattern(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no file matches 'data/train-\*.jsonl'"):
        resolve_files("data/train-*.jsonl", root=tmp_path)


def test_infer_format():
    assert infer_format(["a/x.JSONL", "b/y.jsonl"]) == "jsonl"
    with pytest.raises(ValueError, match="allowed: jsonl, csv, pt, npy"):
        infer_format(["a.txt"])
    with pytest.raises(ValueError, match="different extensions"):
        infer_format(["a.csv", "b.npy"])


def test_write_shards_splits_rows_in_order(tmp_path):
    paths = write_shards(columns(10), tmp_path, shards=4, fmt="pt")
    assert [p.name for p in paths] == [f"train-{i:05d}-of-00004.pt" for i in range(4)]
    assert [count_rows(p, "pt") for p in paths] == [2, 3, 2, 3]
    assert read_columns([str(p) for p in paths], "pt")["id"].tolist() == list(range(10))


def test_dataset_yields_global_batches_in_file_order(tmp_path):
    paths = write_shards(columns(10), tmp_path, shards=2, fmt="jsonl")
    ds = FileDataset.from_patterns(str(tmp_path / "*.jsonl")).batch(4, drop_remainder=False)
    assert ds.format == "jsonl"
    assert [b["id"].tolist() for b in ds] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(list(ds.batch(4))) == 2  # drop_remainder=True
    x, y = next(iter(ds.select("x", "y")))
    assert x.shape == (4, 3) and y.shape == (4, 1)
    assert ds.files == tuple(str(p.resolve()) for p in paths)


def test_shuffle_is_seeded_per_epoch_and_the_same_for_every_worker(tmp_path):
    write_shards(columns(16), tmp_path, shards=2, fmt="npy")
    ds = FileDataset.from_patterns(str(tmp_path / "*.npy")).shuffle(seed=7).batch(16)
    a, b = ds.shard(ShardPlan(AutoShardPolicy.DATA, 2, 0)), ds.shard(ShardPlan(AutoShardPolicy.DATA, 2, 1))
    ids = [a.collate(r)["id"].tolist() for r in a.batches(0)] + [b.collate(r)["id"].tolist() for r in b.batches(0)]
    assert sorted(sum(ids, [])) == list(range(16))  # the same permutation on both: disjoint halves
    assert a.batches(0)[0].tolist() != a.batches(1)[0].tolist()  # epoch 1 reshuffles
    assert a.batches(1)[0].tolist() == ds.shard(ShardPlan(AutoShardPolicy.DATA, 2, 0)).batches(1)[0].tolist()


def test_iterating_a_shuffled_dataset_again_is_the_next_epoch(tmp_path):
    write_shards(columns(16), tmp_path, shards=2, fmt="pt")
    ds = FileDataset.from_patterns(str(tmp_path / "*.pt")).shuffle(seed=7).batch(8)
    first, second = ([b["id"].tolist() for b in ds] for _ in range(2))
    assert first != second and sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(16))
    assert first == [b["id"].tolist() for b in FileDataset.from_patterns(str(tmp_path / "*.pt")).shuffle(seed=7).batch(8)]


def test_fields_that_differ_name_the_file_that_holds_them_after_an_empty_one(tmp_path):
    torch.save({"x": torch.zeros(0, 2)}, tmp_path / "a.pt")
    torch.save({"x": torch.zeros(2, 2)}, tmp_path / "b.pt")
    torch.save({"y": torch.zeros(2, 2)}, tmp_path / "c.pt")
    with pytest.raises(ValueError, match=r"c\.pt: fields \['y'\] differ"):
        read_columns([str(tmp_path / n) for n in ("a.pt", "b.pt", "c.pt")], "pt")


def test_file_shard_loads_only_its_own_files(tmp_path):
    write_shards(columns(12), tmp_path, shards=3, fmt="csv")
    ds = FileDataset.from_patterns(str(tmp_path / "*.csv")).batch(4)
    shard = ds.shard(ShardPlan(AutoShardPolicy.FILE, 2, 1))
    assert [f.rsplit("/", 1)[1] for f in shard.files] == ["train-00001-of-00003.csv"]
    assert shard.columns["id"].tolist() == [4, 5, 6, 7]
    assert [shard.collate(r)["id"].tolist() for r in shard.batches(0)] == [[4, 5], [6, 7]]


def test_a_dataset_needs_a_known_format_and_a_batch(tmp_path):
    with pytest.raises(ValueError, match="allowed"):
        FileDataset(("a.txt",))
    with pytest.raises(ValueError, match="unknown format"):
        FileDataset(("a.jsonl",), format="parquet")
    write_file(tmp_path / "a.jsonl", columns(2))
    with pytest.raises(ValueError, match=r"\.batch\(global_batch_size\)"):
        FileDataset((str(tmp_path / "a.jsonl"),)).shard(ShardPlan(AutoShardPolicy.OFF))


def test_fields_the_files_lack_are_named_with_the_ones_they_hold(tmp_path):
    (path,) = write_shards(columns(8), tmp_path, shards=1, fmt="jsonl")
    ds = FileDataset.from_patterns(str(tmp_path / "*.jsonl")).batch(4).select("x", "label")
    with pytest.raises(MissingFields) as caught:
        ds.shard(ShardPlan(AutoShardPolicy.DATA, 1, 0))
    assert str(caught.value) == (f"the recipe reads fields ['label'], which the input files do not hold "
                                 f"(they hold ['id', 'x', 'y']: {path.resolve()})")
    assert caught.value.explained  # the root-cause panel shows the message alone, without dlaunch's frames


@pytest.mark.parametrize("fmt", FORMATS)
def test_field_width_is_read_from_the_first_row_or_header(tmp_path, fmt):
    path = write_file(tmp_path / f"d.{fmt}", columns() if fmt != "npy" else {"data": columns()["x"]}, fmt)
    field = "data" if fmt == "npy" else "x"
    assert field_width(path, fmt, field) == 3
    assert field_width(path, fmt, "absent") is None


def test_files_narrower_than_the_model_name_the_file_the_width_and_the_key(tmp_path):
    path = write_file(tmp_path / "d.jsonl", columns(), "jsonl")
    dataset = FileDataset((str(path),))
    dataset.check_width("x", 3, "recipe.features")  # as wide as the model: nothing said
    with pytest.raises(FieldWidth) as caught:
        dataset.check_width("x", 32, "recipe.features")
    assert str(caught.value) == (f"{path}: field 'x' holds 3 number(s) per row, but the model is built for "
                                 "recipe.features=32: set recipe.features=3 (or write files whose x holds 32)")
    assert caught.value.explained
