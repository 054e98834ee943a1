"""How coat_ds.deepspeed.checkpoint.space counts a save's bytes and decides which filesystem is short; real engines
and saves are tests/launched/test_checkpoint_space.py's."""
import io

import torch

from coat_ds.deepspeed.checkpoint.space import RankSpace, saved_bytes, shortfalls, with_margin

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


def _on_disk(tensor_bytes: int, files: int) -> int:
    """The most a save's files were measured to hold beyond their tensors (space.py): +1.5%, ~10 KB a file."""
    return int(tensor_bytes * 1.015) + files * 10_000


def test_a_main_job_checkpoint_that_fits_is_not_refused():
    """The issue's case: 2 ranks, the tiny model's 9,387,632 tensor bytes (8.98 MiB on disk; rank 0 writes the model
    file and the scripts too) and 11.0 MiB free. 5% + 1 MiB a rank refused it (needs 11.3 MiB)."""
    ranks = [2_310_784 + 3_538_424, 3_538_424]            # rank 0: model states + its optimizer partition
    spaces = [RankSpace(with_margin(t), int(11.0 * MIB), (), "/run") for t in ranks]
    assert shortfalls(spaces) == []
    disk = _on_disk(ranks[0], 2) + 41_070 + _on_disk(ranks[1], 1)   # + zero_to_fp32.py and zero_to_torch.py
    assert disk <= sum(s.need for s in spaces) <= disk * 1.05                # it covers the files, and closely
    assert shortfalls([RankSpace(with_margin(t), int(8.9 * MIB), (), "/run") for t in ranks]) != []  # short


def test_a_70b_checkpoint_that_fits_is_not_refused():
    """70B CoatAdamW over 8 ranks, ~290 GB of tensors (docs/deepspeed.md): its files fit in 296 GB, which a 5% margin
    refused (it asked for 304.5 GB); the estimate still covers the most the files were measured to hold."""
    per_rank = 290 * 10 ** 9 // 8
    spaces = [RankSpace(with_margin(per_rank), 296 * 10 ** 9, (), "/data")] * 8
    assert shortfalls(spaces) == []
    assert sum(s.need for s in spaces) >= 8 * _on_disk(per_rank, 2)
    assert shortfalls([RankSpace(with_margin(per_rank), 293 * 10 ** 9, (), "/data")] * 8) != []
