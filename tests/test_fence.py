"""The fence around DeepSpeed's internals (coat_ds/deepspeed/fence.py): the installed DeepSpeed's sources of every
method coat_ds re-states, overrides or wraps equal those of a tested release, a changed one is named, and an untested
release warns once at `import coat_ds`."""
from __future__ import annotations

import subprocess
import sys
import warnings

import coat_ds  # noqa: F401  (wraps DeepSpeed's methods: the fence must see through the wraps)
from coat_ds.deepspeed import fence
from harness import child_env
ZERO12 = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"
ZERO3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"


def test_installed_deepspeed_matches_a_tested_release():
    version, diff = fence.installed_version(), fence.changed()
    assert not diff, (f"DeepSpeed {version}'s source differs from {fence.reference()}'s in {len(diff)} methods "
                      "coat_ds depends on; read each, re-state coat_ds's copy, then add the release's hashes "
                      "(docs/versions.md):\n" + "\n".join(f"  {name}  ({fence.METHODS[name]})" for name in diff))
    assert version in fence.TESTED, (f"DeepSpeed {version}: its fenced sources match {fence.reference()}'s; add "
                                     "its hashes to fence.TESTED and raise setup.py's bound (docs/versions.md)")


def test_every_method_is_hashed_for_every_tested_release():
    assert all(sorted(hashes) == sorted(fence.METHODS) for hashes in fence.TESTED.values())


def test_every_override_and_wrap_is_fenced():
    """The other direction: every DeepSpeed method that zero/step.py's and zero/release.py's mixins (ZeRO-1/2 and 3)
    override or engine.py wraps is listed
    (a new override fails here until its hashes are added)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from coat_ds.deepspeed.zero.release import Release, Release3Step, ReleaseStep
    from coat_ds.deepspeed.zero.step import Bf16Step, Zero3Step, Zero12Step

    def name(cls, method):
        return f"{cls.__module__}:{cls.__qualname__}.{method}"

    used = {name(base, m) for mixin, base in ((Zero12Step, DeepSpeedZeroOptimizer), (Bf16Step, BF16_Optimizer),
                                              (Zero3Step, DeepSpeedZeroOptimizer_Stage3),
                                              (Release, DeepSpeedZeroOptimizer), (ReleaseStep, DeepSpeedZeroOptimizer),
                                              (Release, DeepSpeedZeroOptimizer_Stage3),
                                              (Release3Step, DeepSpeedZeroOptimizer_Stage3))
            for m in vars(mixin) if callable(getattr(mixin, m)) and hasattr(base, m) and not m.startswith("__")}
    used |= {name(cls, m) for cls in (DeepSpeedEngine, DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)
             for m, f in vars(cls).items()
             if getattr(f, "_coat_wrapped", False)}
    assert len(used) >= 15 and not used - set(fence.METHODS), sorted(used - set(fence.METHODS))


def test_a_changed_method_is_named(monkeypatch):
    """A re-stated method edited (stage 1/2 step), one behind DeepSpeed's nvtx decorator edited (stage 3 step, which
    keeps no __wrapped__) and one removed: exactly those three are named."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils.nvtx import instrument_w_nvtx

    def step(self, closure=None):
        return "a new release's body"

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "step", step)
    monkeypatch.setattr(DeepSpeedZeroOptimizer_Stage3, "step", instrument_w_nvtx(step))
    monkeypatch.delattr(DeepSpeedZeroOptimizer_Stage3, "_rigid_state_dict")
    assert fence.changed() == [f"{ZERO12}.step", f"{ZERO3}.step", f"{ZERO3}._rigid_state_dict"]


def test_a_changed_private_method_is_named(monkeypatch):
    """ZeRO-3's bucket reduction is private (its name mangled) and behind DeepSpeed's nvtx decorator: an edit of its
    body is named, not hidden behind the decorator's unchanged source."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.utils.nvtx import instrument_w_nvtx

    def __reduce_and_partition_ipg_grads(self, communication_data_type):
        return "a new release's body"

    name = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"
    monkeypatch.setattr(DeepSpeedZeroOptimizer_Stage3, name, instrument_w_nvtx(__reduce_and_partition_ipg_grads))
    assert fence.changed() == [f"{ZERO3}.{name}"]


def test_the_report_line_names_what_differs(monkeypatch):
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    monkeypatch.setattr(BF16_Optimizer, "update_lp_params", lambda self: None)
    assert fence.summary() == (f"1 of {len(fence.METHODS)} methods coat_ds depends on differ from DeepSpeed "
                               f"{fence.reference()}'s: BF16_Optimizer.update_lp_params")


def test_an_untested_release_compares_with_the_newest_tested(monkeypatch):
    monkeypatch.setitem(fence.TESTED, "0.0.1", {})
    assert fence.reference("9.9.9") == "0.19.8" and fence.reference("0.0.1") == "0.0.1"
    assert fence.changed("0.0.1") == list(fence.METHODS)  # an empty record matches nothing


def test_an_untested_release_warns_once_in_one_line(monkeypatch):
    monkeypatch.setattr(fence, "_warned", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not fence.warn_if_untested("0.19.8")
        assert fence.warn_if_untested("0.20.0") and not fence.warn_if_untested("0.20.0")
    assert len(seen) == 1 and issubclass(seen[0].category, fence.UntestedDeepSpeed)
    msg = str(seen[0].message)
    assert "\n" not in msg and "DeepSpeed 0.20.0" in msg and "0.19.8" in msg and "docs/versions.md" in msg


def test_import_coat_ds_warns_on_an_untested_release():
    """A fresh interpreter whose package metadata says deepspeed 0.20.0: `import coat_ds` says so once."""
    code = ("import importlib.metadata as m, warnings; real = m.version; "
            "m.version = lambda n: '0.20.0' if n == 'deepspeed' else real(n); warnings.simplefilter('always'); "
            "import coat_ds, coat_ds.deepspeed.fence as f; f.warn_if_untested()")
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "UntestedDeepSpeed" in ln]
    assert len(lines) == 1 and "DeepSpeed 0.20.0 is installed" in lines[0], proc.stderr[-3000:]
