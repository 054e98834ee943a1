"""How coat_ds.deepspeed.checkpoint.space counts a save's bytes and decides which filesystem is short; real engines
and saves are tests/launched/test_checkpoint_space.py's."""
import io

import torch

from coat_ds.deepspeed.checkpoint.space import RankSpace, saved_bytes, shortfalls

MIB = 2 ** 20


def torch_save_bytes(obj) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.tell()


def test_saved_bytes_counts_each_storage_once_and_a_views_whole_storage_as_torch_save_writes_it():
    flat = torch.zeros(1 << 16)                       # 256 KiB
    state = {"a": flat[:100], "b": [flat[100:200], torch.ones(1000, dtype=torch.bfloat16)], "step": 3,
             "nested": {"same": flat}}
    assert saved_bytes(state) == flat.nbytes + 2000
    assert abs(torch_save_bytes(state) - saved_bytes(state)) < 4096   # the rest is pickled metadata


def test_ranks_sharing_a_filesystem_sum_their_needs():
    spaces = [RankSpace(6 * MIB, 10 * MIB, (), "/data"), RankSpace(6 * MIB, 10 * MIB, (), "/data")]
    assert shortfalls(spaces) == ["needs 12.0 MiB on /data (ranks 0, 1), 10.0 MiB free there"]
    assert shortfalls([RankSpace(4 * MIB, 10 * MIB, (), "/data")] * 2) == []


def test_node_local_filesystems_are_checked_apart_with_the_lowest_free_reading():
    node0, node1 = ("host0", 2049), ("host1", 2049)
    spaces = [RankSpace(3 * MIB, 10 * MIB, node0, "/local"), RankSpace(3 * MIB, 10 * MIB, node0, "/local"),
              RankSpace(3 * MIB, 5 * MIB, node1, "/local"), RankSpace(3 * MIB, 9 * MIB, node1, "/local")]
    assert shortfalls(spaces) == ["needs 6.0 MiB on /local (ranks 2, 3), 5.0 MiB free there"]


def test_sizes_of_a_gibibyte_and_more_are_given_in_gib():
    spaces = [RankSpace(75 * 2 ** 30, 212 * 2 ** 30, (), "/data")] * 4
    assert shortfalls(spaces) == ["needs 300.0 GiB on /data (ranks 0, 1, 2, 3), 212.0 GiB free there"]
