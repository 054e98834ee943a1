"""The DeepSpeed methods coat_ds re-states, overrides or wraps, fenced by the hash of their source per tested release.

coat_ds copies parts of DeepSpeed's private methods (zero/step.py re-states ZeRO-1/2's `step`) and replaces or wraps
others (engine.py, zero/step.py, zero/release.py, zero/master.py, zero/leaf_hooks.py, checkpoint/load.py). A new
DeepSpeed release that edits one of them runs without an error and trains wrongly, so each is listed here with the
sha256 of `inspect.getsource` on every release tested with (docs/versions.md): `changed()` names the methods whose
installed source differs, i.e. the ones to read and re-state before admitting that release. Only the standard
library and packaging at import time: `import coat_ds` calls `warn_if_untested` (importlib.metadata, no DeepSpeed
import), and tests/test_versions.py loads this file alone.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import warnings

from packaging.version import Version

# ZeRO-3's private bucket reduction, by the name Python mangles it to
_Z3_REDUCE = ("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3."
              "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads")

# "module:Class.method" -> where coat_ds depends on its exact body
METHODS: dict[str, str] = {
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.step":
        "re-stated: zero.step.Zero12Step.step and its _coat_* steps",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.unscale_and_clip_grads":
        "applied to a 1 for the kernel's scalar: zero.step.Zero12Step._coat_grad_scale",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.copy_grads_in_partition":
        "overridden: zero.step.Zero12Step",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.reduce_ipg_grads":
        "overridden: zero.release.ReleaseStep (steps each bucket after its reduction)",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.get_all_grad_tensors":
        "overridden: zero.release.ReleaseStep (released gradients are not gathered)",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.get_flat_partition":
        "overridden: zero.release.ReleaseStep (released gradients are not flattened)",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.state_dict":
        "overridden: zero.step.Zero12Step.state_dict",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer._load_legacy_checkpoint":
        "overridden: zero.step.Zero12Step._load_legacy_checkpoint",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer._configure_master_weights":
        "wrapped: engine._coat_master_weights",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._configure_master_weights":
        "wrapped: engine._coat_master_weights (a bf16 master from set-up: _create_fp32_partitions then aliases)",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.step":
        "calls the per-sub-group hooks below in the order zero.step.Zero3Step relies on; its frame (_pre_step, "
        "_partition_all_parameters, _post_step) re-stated: zero.release.Release3Step.step",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._prepare_fp32_grad_for_sub_group":
        "overridden: zero.step.Zero3Step",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads":
        "re-stated: zero.step.Zero3Step.unscale_and_clip_grads",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._optimizer_step":
        "overridden: zero.step.Zero3Step",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._reassign_or_swap_out_partitioned_parameters":
        "overridden: zero.step.Zero3Step",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._rigid_state_dict":
        "overridden: zero.step.Zero3Step",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._rigid_load_state_dict":
        "overridden: zero.step.Zero3Step",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions":
        "re-stated (its branch for equal dtypes): zero.master.use_bf16_master and, wrapped, alias_zero3_masters",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.has_overflow":
        "overridden: zero.step.Zero3Step (reads the flat gradient buffer GradPartitions empties)",
    "deepspeed.runtime.config:DeepSpeedConfig._initialize_params":
        "wrapped: config.check_keys (before); subclassed by deepspeed_keys._parse (the check's own parse)",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer":
        "wrapped: engine._zero3_setup (its last use of self.device is the gradient buffer GradPartitions replaces)",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.initialize_optimizer_states":
        "wrapped: engine._meta_after_states (called by _setup_for_real_optimizer before that buffer)",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks":
        "wrapped: zero.leaf_hooks.replace (its leaf hooks' order, callback and handles: _leaf_module_hooks)",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.partition_grads":
        "indexes the private gradient map that zero.step.GradPartitions replaces; overridden: "
        "zero.release.Release3Step (steps each bucket's slices)",
    _Z3_REDUCE:
        "hands partition_grads each bucket's reduce-scattered slices, which zero.release.Release3Step steps",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.independent_gradient_partition_epilogue":
        "indexes the private gradient map that zero.step.GradPartitions replaces",
    "deepspeed.runtime.bf16_optimizer:BF16_Optimizer.update_lp_params":
        "re-stated: zero.step.Bf16Step.update_lp_params",
    "deepspeed.runtime.engine:DeepSpeedEngine._configure_distributed_model": "wrapped: engine.hook",
    "deepspeed.runtime.engine:DeepSpeedEngine._configure_optimizer": "wrapped: engine.hook",
    "deepspeed.runtime.engine:DeepSpeedEngine._take_model_step": "wrapped: engine.hook",
    "deepspeed.runtime.engine:DeepSpeedEngine.load_checkpoint": "wrapped: engine.hook, checkpoint.load.load",
    "deepspeed.runtime.engine:DeepSpeedEngine._load_checkpoint":
        "re-stated (what it restores besides weights and optimizer): checkpoint.load._engine_state",
    "deepspeed.runtime.engine:DeepSpeedEngine.save_checkpoint":
        "wrapped: engine.hook, checkpoint.space.refuse_if_short (which files each rank writes)",
    "deepspeed.runtime.engine:DeepSpeedEngine._save_checkpoint":
        "what the model states file holds, and on which ranks: checkpoint.space.rank_bytes",
    "deepspeed.runtime.engine:DeepSpeedEngine._save_zero_checkpoint":
        "what an optimizer file holds: checkpoint.space.rank_bytes",
    "deepspeed.runtime.engine:DeepSpeedEngine._common_checkpoint_state":
        "what the model states file holds besides the module: checkpoint.space.rank_bytes",
}

# DeepSpeed release -> {method: sha256 of its inspect.getsource}; its keys are the tested set (setup.py's range)
TESTED: dict[str, dict[str, str]] = {
    "0.19.8": {
        "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.step":
            "9520884fd916d178728985781674b3c26241dde23e71043dc0beabe507b63b5c",
        "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.unscale_and_clip_grads":
            "6bf2ce6f97eafcc24c08a0355e7c180992c8e86da5b7f02026eef6fbd68efa74",
        "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.copy_grads_in_partition":
            "110f723937b99fb9e25405a9d2b85f557a93fc0922447bec94cab940d8ce23ff",
        "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.reduce_ipg_grads":
            "a41525b603f11247356982cea34cf85a3c4519f6ac2e737828a8f5d24abb204f",
        "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.get_all_grad_tensors":
            "412137c5d2d69857063540520f8ea0423d07b7b5ba904427ed6feabec29ec332",
        "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.get_flat_partition":
            "77f7f3dae63109ecb1819225ef11178abbffd3228a7d019d9b929fc40eb6b53f",
        "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.state_dict":
            "2ad067a97760517b00d137f9320a481afd28033e971d09565f4dd68e537a87fb",
        "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer._load_legacy_checkpoint":
            "bbc71a41c161d84e0431f7915c497cb13ea24fbe490b0cc46e7e32af29428938",
        "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer._configure_master_weights":
            "943f724e2d63d918751167f25aaa950d9b1fa7f6d879b056a51d13559d0aeff5",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._configure_master_weights":
            "943f724e2d63d918751167f25aaa950d9b1fa7f6d879b056a51d13559d0aeff5",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.step":
            "c751b3209f83d3b97f416a7bbdd9ca7e0eeafcb3a6072b5abd88440a683fdec9",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._prepare_fp32_grad_for_sub_group":
            "6c19570c775487efc338f5d6b92152090517702d7ed0efa4d7095acb4003b676",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads":
            "3f0d9e8e7861fd44a42cf138d81596b7c36b6170b056302e8776f1cad562ea78",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._optimizer_step":
            "35f8511bba5ff760b250d0b0a7d062d28dda6adb699913a298de4b44dba17951",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._reassign_or_swap_out_partitioned_parameters":
            "af7b449bee8786ec0b8b4c1e27c22bdca2b79186b3888a8c7a9df6bb9c2e8f35",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._rigid_state_dict":
            "9a67500b2f2c4a7a30cfb97ba0045ff6390179b238c7bd967bce96717baa96d5",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._rigid_load_state_dict":
            "4e33833d717fd28b6ca98b8947dffed0b1d57f3df0640ea4f40813cba8ffb603",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions":
            "2d22754c23f57f2968c8abdaa5aa3eaeb7b9e46c954fb4aa7684ac4cc4fc40ba",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.has_overflow":
            "1008a8e067cd7462b7225d87c15b897a67ece8c23cf49002797f8f7c0060f019",
        "deepspeed.runtime.config:DeepSpeedConfig._initialize_params":
            "ccf7da2da6a0dee9a5be741cf701b8970ea566d4e856f312e1f659c812f2df8a",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer":
            "501df2275cc2960cc64dcdf85ac1fc80126e536e04ccac771560f9ffc5ce224d",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.initialize_optimizer_states":
            "e7929e87483515f88cbf98551c0d6928a309efea7802e545f22752763912abf0",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks":
            "cde83f0b853f32867a75057ea1ff5831843424e835b9e15c6ece5787acbc997d",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.partition_grads":
            "93119b25314ec6d345ce60cb66ed87ba3519141e52885daa70b6c67839f7bbeb",
        "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.independent_gradient_partition_epilogue":
            "f1575b87b3d6c08318c77ab7a15231ed71b6c35f494e1877ec08135d30a41b9c",
        _Z3_REDUCE:
            "24d09d54e4e6c38d9a4773f1fdd7c620c11b4b23fc58defadbec5be47efeb845",
        "deepspeed.runtime.bf16_optimizer:BF16_Optimizer.update_lp_params":
            "128911db918ae80c578cc498078940ced1aa16ca181adefc3a3b805f3a0b4a8a",
        "deepspeed.runtime.engine:DeepSpeedEngine._configure_distributed_model":
            "a9a57b807f5eed7291ee4a4bdb0f87bcf49bdd84d09566e913172852d3ef1b70",
        "deepspeed.runtime.engine:DeepSpeedEngine._configure_optimizer":
            "dd82a70f2f92fe125a91e55acaaeed1bb3d167cafad5d317fa4e06984006197f",
        "deepspeed.runtime.engine:DeepSpeedEngine._take_model_step":
            "c4c6e01aa1fc4e7d83fd1076b4105ff104161d5c7d359bcfa2d1ecebdc34b1b8",
        "deepspeed.runtime.engine:DeepSpeedEngine.load_checkpoint":
            "5728d3dfa42a3d6c44836873002f5ccfb9e72091c98029b3843b30ec5651161f",
        "deepspeed.runtime.engine:DeepSpeedEngine._load_checkpoint":
            "45c1953baa73cd3dd02ca7d6120a220d0b2a6dc6eafec72bace05e5714e2c73c",
        "deepspeed.runtime.engine:DeepSpeedEngine.save_checkpoint":
            "c92409217281487c42bc7a932fcbe10c96fd92b144a4060d8fef89c299f1a40b",
        "deepspeed.runtime.engine:DeepSpeedEngine._save_checkpoint":
            "7cec5b09ea912dd591d8c21fb9706b9a1db0b365ccd9ea2ed19bb36cbe16a0a1",
        "deepspeed.runtime.engine:DeepSpeedEngine._save_zero_checkpoint":
            "9053a2fbcfbc2a8721b3ba3f480c2ffdbec451497c6d2d12fde07e7d084fd386",
        "deepspeed.runtime.engine:DeepSpeedEngine._common_checkpoint_state":
            "55303ef952c4f6645072a384719b221f11f193666bc3c4ae312838aec32f983c",
    },
}

DOC = "docs/versions.md"


def source_hash(name: str) -> str | None:
    """sha256 of the installed source of `name` ("module:Class.method"); None where DeepSpeed no longer has it."""
    module, _, path = name.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in path.split("."):
            obj = getattr(obj, part)
        source = inspect.getsource(_unwrap(obj, _unmangled(path.rpartition(".")[2])))
    except (ImportError, AttributeError, OSError, TypeError):
        return None
    return hashlib.sha256(source.encode()).hexdigest()


def _unmangled(name: str) -> str:
    """A private method's own name: `_Class__name` -> `__name` (its function keeps the name it was defined with)."""
    if name.startswith("_") and not name.endswith("__") and "__" in name[1:]:
        return name[name.index("__", 1):]
    return name


def _unwrap(fn, name: str):
    """The function under decorators: functools.wraps' __wrapped__ (coat_ds's own wraps) or, for DeepSpeed's
    instrument_w_nvtx, which keeps no __wrapped__, the closure's function of the same name."""
    while True:
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            cells = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if _has_contents(c)]
            inner = next((c for c in cells if inspect.isfunction(c) and c.__name__ == name), None)
        if inner is None or inner is fn:
            return fn
        fn = inner


def _has_contents(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def installed_version() -> str | None:
    """The installed DeepSpeed's release without a local label (0.19.8+cu130: 0.19.8; changed() still compares its
    sources)."""
    try:
        return Version(importlib.metadata.version("deepspeed")).public
    except importlib.metadata.PackageNotFoundError:
        return None


def reference(version: str | None = None) -> str:
    """The tested release to compare with: `version` (default: the installed one) if tested, else the newest."""
    version = installed_version() if version is None else version
    return version if version in TESTED else max(TESTED, key=Version)


def changed(version: str | None = None) -> list[str]:
    """The methods whose installed source differs from the tested release `reference(version)`: each to be read and
    re-stated (docs/versions.md)."""
    want = TESTED[reference(version)]
    return [name for name in METHODS if source_hash(name) != want.get(name)]


_warned = False


def warn_if_untested(version: str | None = None) -> bool:
    """Warn once per process, one line, if the installed DeepSpeed (or `version`) is outside the tested set; whether
    it warned now."""
    global _warned
    version = installed_version() if version is None else version
    if _warned or version is None or version in TESTED:
        return False
    _warned = True
    warnings.warn(f"coat_ds: DeepSpeed {version} is installed, but coat_ds is tested only with DeepSpeed "
                  f"{', '.join(sorted(TESTED, key=Version))} and re-states some of its methods; see {DOC} "
                  "(python -m coat_ds.report names the methods that differ)", UntestedDeepSpeed, stacklevel=2)
    return True


class UntestedDeepSpeed(UserWarning):
    """The installed DeepSpeed is not one coat_ds was tested with."""


def summary() -> str:
    """One line for `python -m coat_ds.report`: whether the installed sources match the tested ones, naming those that
    do not."""
    diff, ref = changed(), reference()
    if not diff:
        return f"the {len(METHODS)} methods coat_ds re-states, overrides or wraps match DeepSpeed {ref}'s"
    return f"{len(diff)} of {len(METHODS)} methods coat_ds depends on differ from DeepSpeed {ref}'s: " + ", ".join(
        name.partition(":")[2] for name in diff)
