"""FedLPA (Liu et al., NeurIPS 2024; lebronlambert/FedLPA_NeurIPS2024) and RegMean (Jin et al., ICLR 2023;
bloomberg/dataless-model-merging): each Linear / Conv2d layer (and a prototype head) merged from the Kronecker
factors the clients upload as extras, A_k = E[ã ãᵀ] over its inputs and (FedLPA) G_k over its output gradients:

    FedLPA:  Σ_k w_k G_k M A_k = Σ_k w_k G_k W_k A_k   (closed form, refined by preconditioned CG)
    RegMean: M Σ_k w_k A_k = Σ_k w_k W_k A_k           (G = I; exact: M = (Σ w W A)(Σ w A)⁻¹)

with W = [weight | bias] and w = ctx.weights. The factors, the damping, `max_block` and the departures:
docs/baselines.md, `fedlpa` and `regmean`.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from flare.baselines.otfusion import BN_LAYERS, chosen_by
from flare.errors import FlareError
from flare.models import PrototypeHead, create_model
from flare.registry import STRATEGIES, Seed
from flare.server.strategy import ModelPredictor, ServerContext, Strategy

class FactorOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    batches: int = Field(4, ge=1, description="batches of the client's samples the factors average over")
    batch_size: int = Field(128, ge=1, description="samples per batch (the factors' own, not the run's)")
    seed: Seed = Field(0, description="with the run's seed and the client id, picks the samples (and sampled labels)")
    max_block: int = Field(0, ge=0, description="0: full factors; else a factor larger than this is kept "
                                                "block-diagonal, in equal blocks of at most max_block")
    damping: float = Field(1e-3, ge=0, description="F_k + λ I, λ = damping · Σ_k w_k mean(diag F_k), on every factor")


class RegMeanOptions(FactorOptions):
    alpha: float = Field(0.1, ge=0, le=1, description="the Gram matrices' off-diagonal entries times alpha "
                                                      "(RegMean's reduce_non_diag, 0.1 in most of its configs; 1: "
                                                      "plain Gram matrices)")


class FedLPAOptions(FactorOptions):
    damping: float = Field(1.0, ge=0, description="F_k + λ I, λ = damping · Σ_k w_k mean(diag F_k), on A and G")
    fisher: Literal["empirical", "sampled"] = Field(
        "empirical", description="G from the CE gradient of the true labels (the reference's) or of labels drawn "
                                 "from the model's softmax")
    refine_steps: int = Field(50, ge=0, description="at most this many preconditioned CG iterations on the exact "
                                                    "system after the closed form")
    refine_tol: float = Field(1e-6, ge=0, description="stop refining at this relative residual ‖R − L(M)‖ / ‖R‖")


@dataclass(frozen=True)
class Layer:
    """One merged layer: its module's name, the state keys of its weight and bias, its matrix's rows and columns
    (bias column included) and the blocks (count, size) of its A and G factors."""

    name: str
    weight: str
    bias: str | None
    rows: int
    cols: int
    a_blocks: tuple[int, int]
    g_blocks: tuple[int, int]


def blocks(n: int, max_block: int) -> tuple[int, int]:
    """(count, size) of the diagonal blocks of an n×n factor: one full block, or equal blocks ≤ max_block."""
    if max_block <= 0 or n <= max_block:
        return 1, n
    nb = math.ceil(n / max_block)
    return nb, math.ceil(n / nb)


def factor_layers(model: nn.Module, name: str, key: str, max_block: int = 0) -> list[Layer]:
    """The Linear, Conv2d and prototype layers of `model`; a FlareError for any other module with parameters."""
    out = []
    for mname, m in model.named_modules():
        if not any(True for _ in m.parameters(recurse=False)):
            continue
        p = f"{mname}." if mname else ""
        if isinstance(m, PrototypeHead):
            rows, cols, w, b = m.num_classes, m.feature_dim, f"{p}prototypes", None
        elif isinstance(m, nn.Linear):
            rows, cols, w, b = m.out_features, m.in_features, f"{p}weight", m.bias is not None
        elif isinstance(m, nn.Conv2d) and m.groups == 1 and m.padding_mode == "zeros" and not isinstance(
                m.padding, str):
            rows, cols, w, b = m.out_channels, m.in_channels * math.prod(m.kernel_size), f"{p}weight", \
                m.bias is not None
        elif isinstance(m, BN_LAYERS):
            continue
        else:
            raise FlareError(f"server strategy '{name}' cannot merge layer '{mname or '(model)'}' ({type(m).__name__}"
                             f"): it merges Linear, Conv2d (groups=1, zero padding) and prototype-head layers by "
                             f"their factors and averages BatchNorm; nothing else.", key=key,
                             fix=f"leave {name} out of server.primary / eval.rules for this model, or build the "
                                 "model from those layers.")
        b = f"{p}bias" if b is True else None
        cols += b is not None
        out.append(Layer(mname, w, b, rows, cols, blocks(cols, max_block), blocks(rows, max_block)))
    return out


# the client side: the factors of one client
def _accumulate(S: Tensor, v: Tensor, nb: int, bs: int) -> None:
    """S (nb, bs, bs) += the diagonal blocks of vᵀv, v (N, n) zero-padded to nb·bs columns."""
    if nb * bs != v.shape[1]:
        v = F.pad(v, (0, nb * bs - v.shape[1]))
    v = v.reshape(v.shape[0], nb, bs)
    S += torch.einsum("kbi,kbj->bij", v, v)


def _inputs(m: nn.Module, x: Tensor, bias: bool) -> Tensor:
    """The rows ã of the layer's input: (samples × positions) × cols."""
    if isinstance(m, PrototypeHead):
        v = F.normalize(x.float(), dim=1)
    elif isinstance(m, nn.Conv2d):
        u = F.unfold(x.float(), m.kernel_size, m.dilation, m.padding, m.stride)
        v = u.transpose(1, 2).reshape(-1, u.shape[1])
    else:
        v = x.float().reshape(-1, x.shape[-1])
    return torch.cat([v, v.new_ones(v.shape[0], 1)], 1) if bias else v


def _outputs(g: Tensor) -> Tensor:
    """The rows of an output gradient: a conv's (B, C, H, W) as (B·H·W, C)."""
    g = g.float()
    return g.movedim(1, -1).reshape(-1, g.shape[1]) if g.dim() > 2 else g.reshape(-1, g.shape[-1])


def client_factors(model: nn.Module, layers: list[Layer], x: Tensor, y: Tensor, normalize, *, batches: int,
                   batch_size: int, seed: int, fisher: str | None) -> dict[str, Tensor]:
    """`<layer>.A` (and `<layer>.G` when `fisher` is set) of one client, float32, block-diagonal as `layers` say."""
    model = model.eval()
    mods = dict(model.named_modules())
    device = x.device
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(x.shape[0], generator=gen)[: batches * batch_size]
    A = {L.name: torch.zeros(*L.a_blocks, L.a_blocks[1], device=device) for L in layers}
    G = {L.name: torch.zeros(*L.g_blocks, L.g_blocks[1], device=device) for L in layers} if fisher else {}
    rows = {L.name: 0 for L in layers}

    def hook(L: Layer):
        def fn(m, args, out):
            with torch.no_grad():
                for s in range(0, args[0].shape[0], 16):  # unfolded patches in chunks of 16 images
                    v = _inputs(m, args[0][s:s + 16].detach(), L.bias is not None)
                    rows[L.name] += v.shape[0]
                    _accumulate(A[L.name], v, *L.a_blocks)
            if fisher and out.requires_grad:
                out.register_hook(lambda g: _accumulate(G[L.name], _outputs(g), *L.g_blocks))
        return fn

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    handles = [mods[L.name].register_forward_hook(hook(L)) for L in layers]
    try:
        for ix in order.split(batch_size):
            xb = normalize(x[ix.to(device)]).float()
            with torch.enable_grad() if fisher else torch.no_grad():
                xb.requires_grad_(bool(fisher))
                logits = model(xb)[1].float()
                if fisher:
                    if fisher == "sampled":
                        t = torch.multinomial(logits.detach().softmax(-1).cpu(), 1, generator=gen)[:, 0].to(device)
                    else:
                        t = y[ix.to(device)]
                    F.cross_entropy(logits, t, reduction="sum").backward()
    finally:
        for h in handles:
            h.remove()
        for p in params:
            p.requires_grad_(True)
    n = max(1, order.numel())
    out = {f"{k}.A": v / max(1, rows[k]) for k, v in A.items()}
    out.update({f"{k}.G": v / n for k, v in G.items()})
    return {k: v.float().cpu() for k, v in out.items()}


# the server side: one layer's merge
def _left(Gb: Tensor, X: Tensor) -> Tensor:
    """block-diag(Gb) @ X."""
    nb, bs, _ = Gb.shape
    return torch.bmm(Gb, X.reshape(nb, bs, -1)).reshape(nb * bs, -1)


def _right(X: Tensor, Ab: Tensor) -> Tensor:
    """X @ block-diag(Ab)."""
    nb, bs, _ = Ab.shape
    return torch.einsum("rnb,nbc->rnc", X.reshape(X.shape[0], nb, bs), Ab).reshape(X.shape[0], nb * bs)


def damped(Fs: list[Tensor], n: int, damping: float, w: list[float], alpha: float | None = None) -> list[Tensor]:
    """The clients' factors (nb, bs, bs) of real size n, float64: off-diagonals × alpha, + λ I with one λ for all
    clients, λ = (damping + 1e-8) · Σ_k w_k mean diag F_k (so one value fits every layer's scale, and the damping
    does not reweigh the clients), and the padding's diagonal set to 1 (padded rows/columns of M solve to 0)."""
    nb, bs, _ = Fs[0].shape
    eye = torch.eye(bs, dtype=torch.float64, device=Fs[0].device).expand(nb, bs, bs)
    Fs = [Fb.double() for Fb in Fs]
    if alpha is not None and alpha < 1:
        Fs = [alpha * Fb + (1 - alpha) * Fb * eye for Fb in Fs]
    real = torch.arange(nb * bs, device=Fs[0].device).reshape(nb, bs) < n
    scale = sum(wk * Fb.diagonal(dim1=1, dim2=2)[real].mean() for wk, Fb in zip(w, Fs))
    lam = (damping + 1e-8) * torch.as_tensor(scale, dtype=torch.float64).clamp_min(1e-30)
    diag = torch.diag_embed(torch.where(real, lam, torch.ones((), dtype=torch.float64, device=real.device)))
    return [Fb + diag for Fb in Fs]


def _spd_inverse(Fb: Tensor) -> Tensor:
    return torch.cholesky_inverse(torch.linalg.cholesky(Fb))


def solve_layer(Ws: list[Tensor], As: list[Tensor], Gs: list[Tensor] | None, w: Tensor,
                refine_steps: int = 0, tol: float = 1e-13) -> tuple[Tensor, float, float]:
    """M solving Σ w_k G_k M A_k = Σ w_k G_k W_k A_k (G = I when Gs is None: RegMean's exact closed form), with W_k
    padded to the factors' block sizes and the factors damped. Returns M, and the relative residual of the closed
    form and of the refined solution."""
    Ai = _spd_inverse(sum(wk * A for wk, A in zip(w, As)))
    if Gs is None:
        R = sum(wk * _right(W, A) for wk, W, A in zip(w, Ws, As))
        return _right(R, Ai), 0.0, 0.0
    Gi = _spd_inverse(sum(wk * G for wk, G in zip(w, Gs)))

    def L(X: Tensor) -> Tensor:
        return sum(wk * _left(G, _right(X, A)) for wk, G, A in zip(w, Gs, As))

    def P(X: Tensor) -> Tensor:
        return _left(Gi, _right(X, Ai))

    R = sum(wk * _left(G, _right(W, A)) for wk, W, G, A in zip(w, Ws, Gs, As))
    norm = float(R.norm()) or 1.0
    M = P(R)
    r = R - L(M)
    res0 = float(r.norm()) / norm
    z = P(r)
    p, rz = z, float((r * z).sum())
    for _ in range(refine_steps):
        if float(r.norm()) <= tol * norm:
            break
        Lp = L(p)
        a = rz / float((p * Lp).sum())
        M = M + a * p
        r = r - a * Lp
        z = P(r)
        rz, rz_old = float((r * z).sum()), rz
        p = z + (rz / rz_old) * p
    return M, res0, float((R - L(M)).norm()) / norm


def layer_matrix(state: dict[str, Tensor], L: Layer) -> Tensor:
    """The layer's weight (bias as the last column) as a float64 matrix padded to the factors' block sizes."""
    W = state[L.weight].double().reshape(L.rows, -1)
    if L.bias is not None:
        W = torch.cat([W, state[L.bias].double().reshape(L.rows, 1)], 1)
    nbg, bsg = L.g_blocks
    nba, bsa = L.a_blocks
    return F.pad(W, (0, nba * bsa - L.cols, 0, nbg * bsg - L.rows))


def merge(states: list[dict[str, Tensor]], extras: list[dict[str, Tensor]], weights: Tensor, layers: list[Layer],
          opts: FactorOptions, use_g: bool) -> tuple[dict[str, Tensor], dict[str, float]]:
    """The merged state dict: every factor layer solved, everything else (BatchNorm) averaged with the weights."""
    w = [float(x) for x in weights.double().cpu()]
    out = {k: sum(wk * s[k].double() for wk, s in zip(w, states)).to(v.dtype) if torch.is_floating_point(v)
           else v.clone() for k, v in states[0].items()}
    alpha = getattr(opts, "alpha", None)
    res0, res, work = 0.0, 0.0, 0
    for L in layers:
        dev = states[0][L.weight].device
        Ws = [layer_matrix(s, L).to(dev) for s in states]
        As = damped([e[f"{L.name}.A"].to(dev) for e in extras], L.cols, opts.damping, w, alpha)
        Gs = damped([e[f"{L.name}.G"].to(dev) for e in extras], L.rows, opts.damping, w) if use_g else None
        M, r0, r1 = solve_layer(Ws, As, Gs, torch.tensor(w), getattr(opts, "refine_steps", 0),
                                getattr(opts, "refine_tol", 0.0))
        res0, res = max(res0, r0), max(res, r1)
        # float64 working set of this layer: the damped factors, the clients' matrices and ~6 M-sized CG tensors
        work = max(work, 8 * (sum(t.numel() for t in As + (Gs or [])) + (len(Ws) + 6) * Ws[0].numel()))
        M = M[:L.rows, :L.cols]
        wt = states[0][L.weight]
        out[L.weight] = M[:, :L.cols - (L.bias is not None)].reshape(wt.shape).to(wt.dtype)
        if L.bias is not None:
            out[L.bias] = M[:, -1].to(states[0][L.bias].dtype)
    return out, {"residual_closed_form": res0, "residual": res, "work_mb": work / 2 ** 20}


class _Factors(Strategy):
    """The shared machinery: the clients' factors as extras, the per-layer merge on the server."""

    every_round = False
    use_g, _name = False, "regmean"
    one_architecture_why = "it merges the clients' weights layer by layer, which needs one layout"

    def _layers(self, model: nn.Module) -> list[Layer]:
        return factor_layers(model, self._name, chosen_by(self.facts.primary, self._name), self.options.max_block)

    @classmethod
    def check(cls, cfg) -> None:
        """An unsupported layer type is refused at config validation, before any client trains. The dataset's
        channels and classes are not known yet; the layer *types* do not depend on them, so a stand-in model (3
        channels, 10 classes) is inspected, with torch's RNG state restored afterwards."""
        with torch.random.fork_rng(devices=[]):
            try:
                model = create_model(cfg.model.name, 3, 10, cfg.model.width, head=cfg.head, options=cfg.model.options)
            except Exception:  # noqa: BLE001 — a model that needs other dimensions is checked when the run builds it
                return
        factor_layers(model, cls._name, chosen_by(cfg.server.primary, cls._name))

    def extras_shapes(self, template: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        out = {}
        for L in self._layers(template):
            out[f"{L.name}.A"] = ((*L.a_blocks, L.a_blocks[1]), torch.float32)
            if self.use_g:
                out[f"{L.name}.G"] = ((*L.g_blocks, L.g_blocks[1]), torch.float32)
        return out

    def client_extras(self, data) -> dict[str, Tensor]:
        o = self.options
        seed = (int(self.facts.seed) * 1_000_003 + o.seed * 7_919 + int(data.cid)) % (2 ** 62)
        return client_factors(data.model, self._layers(data.model), data.x, data.y, data.normalize,
                              batches=o.batches, batch_size=o.batch_size, seed=seed,
                              fisher=getattr(o, "fisher", None) if self.use_g else None)

    def predictor(self, ctx: ServerContext) -> ModelPredictor:
        t0 = time.perf_counter()
        model = ctx.models[0]  # one layout, and every factor `extras_shapes` declares: the upload gate saw to both
        layers = self._layers(model)
        state, logs = merge([u.state for u in ctx.uploads], ctx.extras, ctx.weights, layers, self.options, self.use_g)
        fused = copy.deepcopy(model)
        fused.load_state_dict(state)
        mb = [sum(v.numel() * v.element_size() for v in e.values()) / 2 ** 20 for e in ctx.extras]
        logs.update(seconds=time.perf_counter() - t0, upload_mb=sum(mb) / max(1, len(mb)), factors_mb=sum(mb),
                    peak_mb=sum(mb) + logs.pop("work_mb"))  # from the tensors' sizes: all factors + one layer's solve
        return ModelPredictor(fused, logs=logs)


@STRATEGIES.register("regmean", options=RegMeanOptions)
class RegMean(_Factors):
    """RegMean: each layer the minimiser of Σ_k w_k ‖(M − W_k) X_kᵀ‖² from the clients' input Gram matrices."""


@STRATEGIES.register("fedlpa", options=FedLPAOptions)
class FedLPA(_Factors):
    """FedLPA: layer-wise Laplace posteriors (K-FAC factors A ⊗ G) aggregated into one model."""

    use_g, _name = True, "fedlpa"
