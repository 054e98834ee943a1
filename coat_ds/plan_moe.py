"""The planner's mixture-of-experts part (`python -m coat_ds.plan`, coat_ds/plan.py): a sparse decoder layer's
routed experts and router, what they weigh and what they keep for backward.

A sparse layer has transformers 5's 3D experts (gate_up [E, 2I, H], down [E, H, I]: 3 x H x I parameters an
expert) and a router [E, H]; a token runs k of the E experts. The optimizer, master and gradients are of every
parameter (total), the GEMMs' work of the k a token reaches (active). Per token the experts keep (bytes per token
per hidden unit, counted from the code, docs/plan.md): coat's ExpertsFn (activation/experts.py) the input's FP8
codes once, not the k gathered copies, and per routed copy its gate/up output in FP8 per 1 x g group, its sorted
position (int64) and routing weight (bf16); transformers' grouped_mm experts (stock) per routed copy the gathered
bf16 input, the gate/up output, act(gate), act(gate) * up and the down output in bf16. The stock router keeps its
fp32 probabilities over E and the top-k indices (int64). tests/test_plan.py holds these to what a CPU layer saves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .hf.coverage import WHY_NOT

# model_type -> (its config's key for experts a layer, for each expert's intermediate size; the router's weight
# precedes the experts' in the module order): the families coat_ds injects (hf/policies.py)
FAMILIES = {"qwen3_moe": ("num_experts", "moe_intermediate_size", False),
            "mixtral": ("num_local_experts", "intermediate_size", True)}
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")   # how HF configs name a layer's experts
# Bytes a routed (token, expert) copy keeps beside its activations: its bf16 routing weight and int64 indices, one in
# ExpertsFn (its sorted position), three in transformers' grouped_mm experts (the gather, the weights, the unsort)
COAT_COPY, STOCK_COPY = 2 + 8, 2 + 3 * 8
ROUTER_SLOT = 8          # bytes per token and slot the stock router keeps beside its probabilities: the int64 index


class MoeError(ValueError):
    """A mixture-of-experts config the planner has no model for: one line naming the key and what is allowed."""


@dataclass(frozen=True)
class Experts:
    """A sparse layer's routed experts and router."""
    num: int                          # experts a layer (E)
    top_k: int                        # experts a token (k)
    intermediate: int                 # each expert's intermediate size (I)
    router_first: bool = False        # the router's weight comes before the experts' in module order (Mixtral)
    dense_layers: tuple[int, ...] = ()   # layers with a dense MLP instead (Qwen3-MoE: mlp_only_layers, sparse step)

    def expert_values(self, hidden: int) -> tuple[int, int]:
        """Values of the layer's two 3D expert weights: gate_up [E, 2I, H], down [E, H, I]."""
        return self.num * 2 * self.intermediate * hidden, self.num * hidden * self.intermediate

    def tensors(self, hidden: int) -> list[int]:
        """The sparse MLP's parameters' values in module order: router, gate_up, down (Qwen3-MoE: router last)."""
        experts = list(self.expert_values(hidden))
        router = [self.num * hidden]
        return router + experts if self.router_first else experts + router

    def params(self, hidden: int) -> int:
        """A sparse MLP's parameters: every expert's and the router's."""
        return sum(self.tensors(hidden))

    def active_params(self, hidden: int) -> int:
        """What one token's forward runs through: k experts and the router."""
        return self.top_k * 3 * hidden * self.intermediate + self.num * hidden

    def backward_bytes(self, hidden: int, activation: Any, tokens: int) -> float:
        """Bytes one sparse layer's backward holds beside the activations at its highest, `tokens` tokens routed to
        k experts each (pairs): coat's ExpertsFn (activation/experts.py), from allocator traces of Qwen3-30B-A3B's
        step (benchmarks/logs/moe_one_gpu_*trace*_2026-12-03.log). At the input gradient: the gate_up FP8 codes
        (1 B a value), their dequantized bf16 copy (2 B), the down projection's bf16 gradient (2 B); per pair the
        gate/up gradient in FP8 (2I) and dequantized (4I), the input gradient (2H). At the gate_up gradient's
        grouped GEMM: the down gradient; per pair the input gradient (2H), the FP8 gate/up gradient (2I), both
        dequantized operands (4I, 2H) beside their copies padded to the groups (the same again). Then its output
        (2 B a gate_up value) beside the K-contiguous copies. The stock experts: 0 (not traced)."""
        if activation is None or not activation.enabled:
            return 0.0
        gate_up, down = self.expert_values(hidden)
        i, h, pairs = self.intermediate, hidden, self.top_k * tokens
        return max(3.0 * gate_up + 2.0 * down + pairs * (6 * i + 2 * h),
                   2.0 * down + pairs * (10 * i + 6 * h),
                   2.0 * gate_up + 2.0 * down + pairs * (6 * i + 4 * h))

    def saved_bytes(self, hidden: int, activation: Any) -> float:
        """Bytes per token per hidden unit the router and the experts keep for backward beyond what a dense layer's
        norm term counts: `activation` coat's ActivationConfig (its experts always run ExpertsFn), None: stock."""
        k, i, g = self.top_k, self.intermediate, (activation.group_size if activation else 16)
        router = (4 * self.num + ROUTER_SLOT * k) / hidden
        if activation is None or not activation.enabled:   # transformers' grouped_mm experts, bf16
            experts = k * (4 * hidden + 8 * i + STOCK_COPY) / hidden
        else:   # the router's bf16 input (full mode: the norm keeps FP8 only) + the FP8 input codes; FP8 gate/up
            norm_out = 3.0 if activation.mode == "full" else 2.0
            experts = norm_out + k * (2 * i * (1 + 1 / g) + COAT_COPY) / hidden
        return router + experts


def experts_from_hf(cfg: Mapping[str, Any], where: str) -> Experts | None:
    """The Experts of an HF config (a text config), None for a dense model; MoeError for a family without a model."""
    key = next((k for k in EXPERT_KEYS if cfg.get(k)), None)
    if key is None:
        return None
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        why = f" ({WHY_NOT[model_type]})" if model_type in WHY_NOT else ""
        raise MoeError(f"{where}: model_type={model_type!r}, a mixture of experts ({key}) coat_ds does not "
                       f"inject{why}; allowed: dense Llama-family models or {sorted(FAMILIES)}")
    num_key, inter_key, router_first = FAMILIES[model_type]
    bad = [k for k in (num_key, inter_key, "num_experts_per_tok") if not isinstance(cfg.get(k), int)]
    if bad:
        raise MoeError(f"{where}: no integer {bad[0]}; allowed: a {model_type} config.json")
    layers, step = cfg.get("num_hidden_layers", 0), cfg.get("decoder_sparse_step") or 1
    only = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)   # Qwen3-MoE's rule for a dense MLP
    return Experts(cfg[num_key], cfg["num_experts_per_tok"], cfg[inter_key], router_first, dense)
