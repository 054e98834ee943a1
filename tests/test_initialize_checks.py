"""deepspeed.initialize in a user's own script, with a "coat" section or CoatAdamW: DeepSpeed's keys are checked as
DeepSpeed starts to parse the config (config.check_keys), so a bad value is refused in one line naming the key
before anything is built; DeepSpeed's own parser raised two pydantic tracebacks ("bf16": {"enable": true}) or an
AssertionError (a micro-batch of 0). A config that does not run coat_ds is DeepSpeed's alone."""
import json
import textwrap

import pytest

from harness import run_one_rank_job

pytest.importorskip("deepspeed")

BASE = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "CoatAdamW", "params": {"lr": 1e-3}}}
BAD = [({"bf16": {"enable": True}}, "bf16.enable"),
       ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu")]
WITHOUT_COAT = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enable": True},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
CONFIGS = [{**BASE, **bad} for bad, _ in BAD] + [WITHOUT_COAT]
# every config's deepspeed.initialize in one one-rank process (one import of torch and DeepSpeed, not three)
JOB = textwrap.dedent("""
    import json
    import torch
    import deepspeed
    import coat_ds

    def outcome(cfg):
        model = torch.nn.Linear(8, 8)
        try:
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            return {"error": None}
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc)}

    print("RESULT " + json.dumps([outcome(cfg) for cfg in json.loads(CONFIGS)]))
""").replace("CONFIGS", repr(json.dumps(CONFIGS)))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[dict]:
    return run_one_rank_job(tmp_path_factory.mktemp("initialize_checks"), JOB)


@pytest.mark.parametrize("case", range(len(BAD)), ids=[names for _, names in BAD])
def test_a_bad_value_is_refused_in_one_line_naming_the_key(outcomes, case):
    out, names = outcomes[case], BAD[case][1]
    assert out["error"] == "ValueError" and "\n" not in out["message"] and names in out["message"], out


def test_a_config_without_coat_is_deepspeeds_alone(outcomes):
    out = outcomes[CONFIGS.index(WITHOUT_COAT)]
    assert out["error"] == "ValidationError" and "\n" in out["message"], out   # pydantic's, several lines
