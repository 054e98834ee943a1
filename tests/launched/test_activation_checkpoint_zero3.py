"""coat.activation.checkpoint through plain deepspeed.initialize, ZeRO-3 on 2 ranks (CPU accelerator, gloo;
tests/ds_scripts/checkpoint_job.py): the in-process cases (HF's switch, HF Trainer, coat_ds.inject) are
tests/test_activation_checkpoint.py."""
import pytest

from harness import module_tasks, ranks


SECTION_TASKS = ["checkpoint_job.release", "checkpoint_job.grads"]   # in the session's one launch of section_job.py


@pytest.fixture(scope="module")
def job(section_launch) -> dict:
    return module_tasks(section_launch, SECTION_TASKS)


def _checkpointed_as_configured(r: dict, saved_off_at_least: float) -> None:
    """checkpoint false: every layer saves its FP8 activations, none is run again; true: each layer saves only its
    input (2 B per token per hidden unit in bf16, 4 in fp32) and runs its forward again in backward."""
    off, on = r["off"], r["on"]
    assert off["checkpointed"] == [False, False] and on["checkpointed"] == [True, True], r
    assert off["backward_forwards"] == 0 and on["backward_forwards"] == 2, r
    assert min(off["saved_per_layer"]) >= saved_off_at_least, r
    assert on["losses"] == off["losses"] and r["weights_equal"], r


def test_zero3_largest_model_preset_checkpointed_trains_bit_for_bit(job):
    """ds_configs/zero3_largest_model.json (gradients released in backward, bf16_sr master, attention_fp8), every
    parameter partitioned: with the recompute the losses and final weights equal the run without it, bit for bit
    (the FP8 quantization is deterministic and the bf16_sr rounding draws from an RNG the recompute leaves as it
    was), and each layer keeps 2 B/token/hidden instead of its FP8 activations."""
    for r in ranks(job, "release"):
        _checkpointed_as_configured(r, saved_off_at_least=8.0)
        assert r["on"]["saved_per_layer"] == [2.0, 2.0], r


def test_zero3_full_gradients_with_the_recompute_are_the_same(job):
    """ZeRO-3 in fp32 (torch AdamW): every parameter's full gradient after the first backward is equal, bit for bit,
    with the recompute and without it."""
    for r in ranks(job, "grads"):
        _checkpointed_as_configured(r, saved_off_at_least=16.0)
        assert r["on"]["saved_per_layer"] == [4.0, 4.0] and r["grads_equal"], r
