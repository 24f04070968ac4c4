"""Mixture-of-experts feed-forward blocks (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss) and their families.

A router (one small matrix) scores every expert for each token; the token goes to its `top_k`
experts, weighted by the softmax of the scores (renormalised over the chosen ones where the model
says so), and the weighted sum of their SwiGLU outputs is the block's output. Qwen2-MoE adds a
shared expert on every token, scaled by a sigmoid gate. gpt-oss adds biases (router and experts),
takes the softmax over the top-k scores alone, and clamps its SwiGLU (`expert_activation`).

The experts run grouped: the step's (token, choice) pairs are sorted by expert, each chosen
expert's rows are gathered into one matrix, and that expert runs once (one gate-and-up product, one
down product) on all of them; experts no token chose are not touched, so a step reads only the
weights it uses and its cost follows the number of experts chosen, not the number the model has.
Each token's outputs are then summed in the order of its own choices, in float32, so a token's
result does not depend on the other tokens of the step (batch invariance: dense products also run
in row chunks, as `Linear` does; the quantized kernels compute each row alike for any row count).

Expert weights are kept in the file's form: a GGUF file's stacked [experts, rows, cols] blocks are
split into one `QuantizedTensor` per expert (gate and up joined per expert), used by the same
kernels as every other quantized matrix; dense weights stay in the model's dtype. Under
torch.compile the grouped loop is one opaque operator, `treadle::moe_experts`.
"""

import torch
import torch.nn.functional as F

from treadle.model.config import ModelConfig, ModelLoadError, MoEConfig
from treadle.model.kernels.quant import QuantizedTensor
from treadle.model.kernels.quant import matmul as quant_matmul
from treadle.model.layers.linear import Linear
from treadle.model.loading.deferred import DeferredWeight

DENSE = -1  # the operator's type id of a dense (not quantized) expert weight

# Tests count the grouped products through this: called as hook(expert, rows) once per expert run.
expert_run_hook = None


def _product(x: torch.Tensor, weight: torch.Tensor, type_id: int, row_chunk: int) -> torch.Tensor:
    if type_id != DENSE:
        return quant_matmul(x, weight, type_id)
    if row_chunk and x.shape[0] > row_chunk:
        return torch.cat([F.linear(part, weight) for part in x.split(row_chunk)])
    return F.linear(x, weight)


def expert_activation(
    gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float, gelu: bool = False
) -> torch.Tensor:
    """silu(gate) * up; with limit > 0 gpt-oss's clamped SwiGLU: gate clamped above at `limit`, up
    to +-limit, then (up + 1) * gate * sigmoid(alpha * gate) (as transformers' GptOssExperts);
    gelu: Gemma 4's GeGLU, tanh-approximated gelu(gate) * up."""
    if gelu:
        return F.gelu(gate, approximate="tanh") * up
    if not limit:
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def run_experts(
    x: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    gate_up: list[torch.Tensor],
    down: list[torch.Tensor],
    gate_up_type: int,
    down_type: int,
    row_chunk: int,
    gate_up_bias: list[torch.Tensor],
    down_bias: list[torch.Tensor],
    swiglu_limit: float,
    swiglu_alpha: float,
    gelu: bool = False,
) -> torch.Tensor:
    """x [T, H]; chosen [T, k] expert ids, weights [T, k] float32 -> [T, H] in x's dtype: the sum
    over each token's choices of weight * down(act(gate, up)), each chosen expert run once (with
    each expert's biases after its products, where given (else empty lists): gpt-oss)."""
    t, k = chosen.shape
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
    counts = torch.bincount(flat, minlength=len(gate_up)).tolist()
    gathered = x[order // k]
    out = torch.empty((t * k, x.shape[1]), dtype=x.dtype)
    start = 0
    for expert, n in enumerate(counts):
        if not n:
            continue
        projected = _product(gathered[start : start + n], gate_up[expert], gate_up_type, row_chunk)
        if gate_up_bias:
            projected = projected + gate_up_bias[expert]
        gate, up = projected.chunk(2, dim=-1)
        y = _product(expert_activation(gate, up, swiglu_limit, swiglu_alpha, gelu), down[expert], down_type, row_chunk)
        out[order[start : start + n]] = y + down_bias[expert] if down_bias else y
        if expert_run_hook is not None:
            expert_run_hook(expert, n)
        start += n
    out = out.view(t, k, -1)
    acc = out[:, 0].float() * weights[:, :1]
    for j in range(1, k):  # each token's choices in its own order: independent of the other tokens
        acc += out[:, j].float() * weights[:, j : j + 1]
    return acc.to(x.dtype)


# `run_experts` as one torch operator (the same function): compiled graphs call the grouped loop whole.
moe_experts_op = torch.library.custom_op("treadle::moe_experts", run_experts, mutates_args=())


@moe_experts_op.register_fake
def _(x, chosen, weights, gate_up, down, gate_up_type, down_type, row_chunk, *rest):
    return torch.empty_like(x)


class ExpertWeights:
    """A stacked [experts, rows, cols] weight as a file holds it (a GGUF `*_exps` tensor): one
    QuantizedTensor per expert, or a dense loader's tensor split at use."""

    def __init__(self, parts: list[QuantizedTensor]):
        self.parts = parts
        self.shape = torch.Size((len(parts), *parts[0].shape))


def _joined(parts: list, where: str) -> tuple[torch.Tensor, int, str]:
    """One expert's matrices (gate and up, or down alone) as one stored weight: its data, the
    operator's type id, and the type its bytes are counted under. Gate and up must be of one type
    (one product): a dense copy of quantized experts is never made."""
    quantized = [p for p in parts if isinstance(p, QuantizedTensor)]
    if quantized:
        if len(quantized) != len(parts) or len({p.kind for p in quantized}) != 1:
            kinds = [p.kind if isinstance(p, QuantizedTensor) else str(p.dtype) for p in parts]
            raise ModelLoadError(
                f"{where}: the experts' gate and up weights are of different types ({', '.join(kinds)}): not supported"
            )
        q = parts[0] if len(parts) == 1 else QuantizedTensor.cat(parts)
        return q.data, q.type_id, q.kind
    dense = parts[0] if len(parts) == 1 else torch.cat(parts)
    return dense, DENSE, str(dense.dtype).removeprefix("torch.")


class FeedForward:
    """A SwiGLU MLP (the shared expert)."""

    def __init__(self, gate_up: Linear, down: Linear):
        self.gate_up, self.down = gate_up, down

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class MoE:
    """One layer's experts, router and (optional) shared expert, taken off the loader's dict.

    Names (after the layer's prefix): the router `router`; experts under `experts`, either one
    weight per expert (`{experts}.{e}.{gate}.weight`, as checkpoints store them) or stacked
    (`{experts}.{gate}`: a GGUF file's, or transformers' fused `gate_up_proj` / `down_proj`)."""

    def __init__(
        self,
        config: ModelConfig,
        lw,
        router: str = "mlp.gate.weight",
        experts: str = "mlp.experts",
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        shared: str = "mlp.shared_expert",
        shared_gate: str = "mlp.shared_expert_gate.weight",
        fused_gate_up: str = "gate_up_proj",
    ):
        moe: MoEConfig = config.moe
        self.fused_gate_up = fused_gate_up  # the stacked gate-and-up weight's name, where a checkpoint fuses them
        self.top_k, self.norm_topk, self.softmax_after_topk = moe.top_k, moe.norm_topk, moe.softmax_after_topk
        self.swiglu = (moe.swiglu_limit, moe.swiglu_alpha, moe.gelu)
        router_bias = lw.take(router.removesuffix("weight") + "bias") if moe.biases else None
        self.router = lw.linear((router,), router_bias)
        gate, up, down = (self._experts(lw, experts, name, moe.num_experts, fused_gate_up) for name in names)
        gate_up = [_joined([g, u], lw.prefix + experts) for g, u in zip(gate, up)]
        downs = [_joined([d], lw.prefix + experts) for d in down]
        for forms, what in ((gate_up, "gate/up"), (downs, "down")):
            if len({type_id for _, type_id, _ in forms}) != 1:
                raise ModelLoadError(f"{lw.prefix}{experts}: the experts' {what} weights are not all of one type")
        self.gate_up, self.gate_up_type, self.gate_up_kind = [d for d, _, _ in gate_up], gate_up[0][1], gate_up[0][2]
        self.down, self.down_type, self.down_kind = [d for d, _, _ in downs], downs[0][1], downs[0][2]
        self.gate_up_bias, self.down_bias = [], []
        if moe.biases:  # stacked [experts, rows], named after the weights: `{experts}.{name}_bias`
            gate_b, up_b, down_b = (lw.take(f"{experts}.{name}_bias") for name in names)
            self.gate_up_bias = list(torch.cat([gate_b, up_b], dim=1).unbind(0))
            self.down_bias = list(down_b.unbind(0))
        self.row_chunk = 0  # batch-invariant mode: dense expert products in chunks of this many rows
        self.shared = self.shared_gate = None
        if moe.shared_size:
            self.shared = FeedForward(
                lw.linear((f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight")),
                lw.linear((f"{shared}.down_proj.weight",)),
            )
            gate = lw.take(shared_gate)  # [1, H]; llama.cpp keeps it as a vector [H]
            if gate.numel() != config.hidden_size:
                raise ModelLoadError(
                    f"weight {lw.prefix}{shared_gate}: {gate.numel()} values, expected {config.hidden_size}"
                )
            self.shared_gate = Linear(gate.reshape(1, -1))

    @staticmethod
    def _experts(lw, experts: str, name: str, n: int, fused_gate_up: str = "gate_up_proj") -> list:
        """Expert e's `name` weight for every e, in its stored form."""
        stacked = lw.prefix + f"{experts}.{name}"
        fused_key = lw.prefix + f"{experts}.{fused_gate_up}"
        if stacked in lw.w or (name in ("gate_proj", "up_proj") and fused_key in lw.w):
            if stacked not in lw.w:  # a fused [E, 2F, H] (transformers', Granite's): gate rows, then up
                fused = lw.w[fused_key]
                if isinstance(fused, ExpertWeights):  # a GGUF file's ffn_gate_up_exps: whole rows moved
                    half = fused.shape[1] // 2
                    if name == "up_proj":
                        lw.w.pop(fused_key)
                    rows = slice(0, half) if name == "gate_proj" else slice(half, None)
                    return [p.index_rows(rows) for p in fused.parts]
                if isinstance(fused, DeferredWeight):  # a folder's, read once for gate and up
                    fused = lw.w[fused_key] = fused.to(device=lw.device, dtype=lw.dtype)
                half = fused.shape[1] // 2
                part = fused[:, :half] if name == "gate_proj" else fused[:, half:]
                if name == "up_proj":
                    lw.w.pop(fused_key)
                return [p.to(device=lw.device, dtype=lw.dtype) for p in part]
            weight = lw.w.pop(stacked)
            if weight.shape[0] != n:
                raise ModelLoadError(f"weight {stacked}: {weight.shape[0]} experts, expected {n}")
            if isinstance(weight, ExpertWeights):
                if torch.device(lw.device).type == "cpu":
                    return weight.parts
                return [p.to(device=lw.device, dtype=lw.dtype) for p in weight.parts]
            return list(weight.to(device=lw.device, dtype=lw.dtype).unbind(0))
        return [lw.take_part(f"{experts}.{e}.{name}.weight") for e in range(n)]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts' weights (float32) and ids, [T, top_k] each."""
        if self.softmax_after_topk:  # gpt-oss: the softmax over the chosen experts' scores alone
            scores, chosen = self.router(x).float().topk(self.top_k, dim=-1)
            return scores.softmax(dim=-1), chosen
        weights, chosen = self.router(x).float().softmax(dim=-1).topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def __call__(self, x: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
        """The block over x; the router reads `router_input` where the model routes on another
        stream (Gemma 4: the residual before the experts' own norm), else x."""
        weights, chosen = self.route(x if router_input is None else router_input)
        run = moe_experts_op if torch.compiler.is_compiling() else run_experts
        y = run(
            x, chosen, weights, self.gate_up, self.down, self.gate_up_type, self.down_type, self.row_chunk,
            self.gate_up_bias, self.down_bias, *self.swiglu,
        )  # fmt: skip
        if self.shared is not None:
            y = y + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return y

    def linears(self) -> list[Linear]:
        out = [self.router]
        if self.shared is not None:
            out += [self.shared.gate_up, self.shared.down, self.shared_gate]
        return out

    def stored_forms(self) -> list[tuple[torch.Tensor, str]]:
        """The experts' tensors, with the type their bytes are counted under."""
        return [(t, self.gate_up_kind) for t in self.gate_up] + [(t, self.down_kind) for t in self.down]


# ---------------------------------------------------------------- shapes and files


def moe_shapes(
    config: ModelConfig,
    layer: int,
    shapes: dict,
    prefix: str,
    router="mlp.gate.weight",
    experts="mlp.experts",
    names=("gate_proj", "up_proj", "down_proj"),
) -> None:
    """A sparse layer's weights in `shapes` (HF names) in place of its dense MLP's."""
    moe, h = config.moe, config.hidden_size
    for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
        shapes.pop(prefix + name, None)
    f, n = moe.expert_size, moe.num_experts
    shapes[prefix + router] = (n, h)
    for name, shape in zip(names, ((f, h), (f, h), (h, f))):
        shapes[prefix + f"{experts}.{name}"] = (n, *shape)
        for e in range(n):
            shapes[prefix + f"{experts}.{e}.{name}.weight"] = shape
    if moe.shared_size:
        s = moe.shared_size
        shapes.update(
            {
                prefix + "mlp.shared_expert.gate_proj.weight": (s, h),
                prefix + "mlp.shared_expert.up_proj.weight": (s, h),
                prefix + "mlp.shared_expert.down_proj.weight": (h, s),
            }
        )  # fmt: skip (the gate: [1, H] or GGUF's [H], checked at load)
