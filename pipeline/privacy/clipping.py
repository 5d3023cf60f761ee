"""Clippers: what one rank contributes to a DP step's sum. The step itself (all-reduce, noise,
division) is `engine.dp_step`; nothing here adds noise.

- `BookKeepingClipper`: exact per-example clipping in one backward pass. Forward hooks keep each
  layer's input, tensor hooks keep the gradient of its output; one backward of Σ_i loss_i then gives,
  per layer and example, everything its per-example gradient is made of (the rules in
  layer_rules.py). Norms are summed over layers, c_i = min(1, C/‖g_i‖), and Σ_i c_i g_i is formed
  from the same tensors: no second backward. Parameters are held out of autograd (requires_grad
  off) so the backward computes only what the hooks read. Under dp.compile the same records come
  from inside the compiled graph (compiled_records.py). A layer whose per-example gradients take
  no more floats than its output gradient (LayerNorm: B·2d against B·T·d) is reduced to them
  inside the backward, as its output gradient arrives: holding every LayerNorm's input and output
  gradient to the end took the clipped step from about 1.05× to 1.2-1.3× the non-private memory.
  Under bf16 autocast the records keep the forward's bf16 and each layer is upcast to fp32 in its
  turn, then dropped: upcasting them all after the backward held every layer twice over in fp32
  (1.6× the non-private memory for the captioner).
- `VmapClipper`: the reference, per-example gradients from torch.func (any layer, O(B·params) memory).
- `PerBatchClipper`: for batch-coupled losses (CLIP); the batch gradient, clipped once after the
  ranks' parts are summed (`finish`).
- `PlainSum`: the unclipped sum, for the non-private baseline only.

Clip groups (`encoder_share`, dp.encoder_clip_share): each example's gradient may be split into the
image encoder's part and the rest's, clipped to C·√s and C·√(1−s). The contribution's norm is then at
most √(C²s + C²(1−s)) = C, the sensitivity the accountant is told. It pays where one part dwarfs the
other: a randomly initialised text decoder takes over 9/10 of the captioner's squared norm at its warm
start (benchmarks/gradient_norms.py), so under one bound the encoder, whose features the run is for,
gets ~C/4 of every example.

Mask views (`views`, dp.mask_views): each example comes as K consecutive rows of the batch, one per
mask drawn for it, and its gradient is the mean over its rows, clipped once. It is a function of the
one example (and of masks drawn from the secret key), so one example still moves the sum by at most
C: the same ε. Averaging K masks removes the masking's own noise from each example's gradient, so
the clipped mean carries more signal against the same σC (benchmarks/gradient_norms.py --views).

Only the model's forward runs under autocast. Norms, clip factors, sums: fp32 (fp64) with autocast
switched off, whatever the caller's context: in bf16 a clipped contribution could exceed C, and in
fp16 the ghost-norm Gram products overflow. fp16 multiplies the loss by a fixed `loss_scale` (not
one that reacts to overflows: that would depend on private data); an example whose norm is not
finite contributes nothing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

from pipeline.privacy import layer_rules
from pipeline.privacy.layer_rules import SUPPORTED_LAYERS, bounded_sq_norms, fp32_only, rule_for

SUM_DTYPE = torch.float64  # per-example sums of several parts: fp32's rounding grew with B (docs/privacy.md)


def zero_sums(params: dict, dtype: torch.dtype, parts: int) -> dict:
    """Zeroed sums adding up `parts` partial sums (micro-batches × ranks) in `dtype`; one part stays fp32."""
    return {n: torch.zeros_like(p, dtype=dtype if parts > 1 else torch.float32) for n, p in params.items()}


# Instantiated per-example gradients may hold this share of the bytes of the layers' inputs and output
# gradients: memory for time. 0.04 keeps a one-part step within 1.1x (tests/test_clipping_memory.py).
HELD_BUDGET = 0.04


@dataclass
class ClipStats:
    norms: list            # per-example (or per-batch) gradient norms before clipping
    nonfinite: int = 0     # examples whose norm was not finite: they contribute nothing


class UnboundableModel(TypeError):
    """The model has something per-example clipping cannot bound; the message names it."""


def reject_unboundable(model: nn.Module, per_example_rules: bool, per_example: bool = True) -> None:
    """Refuse, before step 1, what would break the bound C: buffers that change with the data
    (BatchNorm's running statistics leave the DP boundary un-noised); per example, normalising over
    the batch (one example moves the others' gradients: 20·C with a bare BatchNorm1d); with
    `per_example_rules` (the book-keeping clipper) also parameters outside a registered layer and tied
    ones (a norm up to √2 off)."""
    problems = [f"{name or 'the model'} ({type(m).__name__}) " + ("keeps running statistics of its inputs"
                if m.track_running_stats else "normalises over the batch, which couples the examples")
                for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._NormBase)
                and (m.track_running_stats or per_example and isinstance(m, nn.modules.batchnorm._BatchNorm))]
    if per_example_rules:
        owners: dict[int, list[str]] = {}
        for name, m in model.named_modules():
            for attr, p in m.named_parameters(recurse=False):
                if p.requires_grad:
                    owners.setdefault(id(p), []).append(f"{name}.{attr}" if name else attr)
                    if rule_for(m) is None:
                        problems.append(f"{name or 'the model'}.{attr} belongs to {type(m).__name__}, which has no "
                                        f"clipping rule (supported: {', '.join(t.__name__ for t in SUPPORTED_LAYERS)})")
        problems += [f"one parameter is tied to {', '.join(names)}" for names in owners.values() if len(names) > 1]
    if problems:
        raise UnboundableModel("DP training cannot bound this model's per-example influence: " + "; ".join(problems))


def view_rows(batch: tuple[torch.Tensor, ...], masks: torch.Tensor | None, views: int) -> tuple[torch.Tensor, ...]:
    """The model's inputs for `views` masks per example: each input repeated K times in a row, so rows
    i·K … i·K + K − 1 are example i's (as the clippers group them), and the masks (b, K, P) as (b·K, P)."""
    rows = tuple(x.repeat_interleave(views, dim=0) for x in batch) if views > 1 else tuple(batch)
    return rows if masks is None else rows + (masks.reshape(-1, masks.shape[-1]),)


def _zero_rows(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep.view(-1, *[1] * (x.dim() - 1)), x, torch.zeros_like(x))


def clip_factors(norms: torch.Tensor, clip_norm: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """min(1, bound/norm) and whether the norm is finite; `norms` (G, B) against `clip_norm` (G, 1) clips
    each group of each example to its own bound."""
    finite = torch.isfinite(norms)
    factors = torch.where(finite, (clip_norm / (norms + 1e-6)).clamp(max=1.0), torch.zeros_like(norms))
    return factors, finite


def group_bounds(model: nn.Module, clip_norm: float, encoder_share: float | None) -> tuple[dict[int, int], list[float]]:
    """({id(parameter): its clip group}, each group's bound). One group of bound C, or with `encoder_share`
    s the image encoder's parameters (the shallowest module named `encoder`) bound to C·√s and the rest
    to C·√(1−s): Σ_g bound_g² = C², so a clipped example's whole gradient stays within C."""
    params = [p for p in model.parameters() if p.requires_grad]
    if encoder_share is None:
        return {id(p): 0 for p in params}, [clip_norm]
    if not 0 < encoder_share < 1:
        raise ValueError(f"encoder_clip_share must lie strictly between 0 and 1, not {encoder_share}")
    named = [(name, m) for name, m in model.named_modules() if name.split(".")[-1] == "encoder"]
    if not named:
        raise ValueError("encoder_clip_share needs a model with an image `encoder` module")
    encoder = min(named, key=lambda nm: nm[0].count("."))[1]
    mine = {id(p) for p in encoder.parameters()}
    group_of = {id(p): 0 if id(p) in mine else 1 for p in params}
    for group, part in enumerate(("the image encoder", "the rest of the model")):
        if group not in group_of.values():  # its share of C would bound no gradient: wasted, not unsafe
            raise ValueError(f"encoder_clip_share={encoder_share} gives {part} its own share of C, but none of "
                             "its parameters trains (dp.frozen): set encoder_clip_share to null")
    return group_of, [clip_norm * encoder_share ** 0.5, clip_norm * (1 - encoder_share) ** 0.5]


def grouped_factors(sq: torch.Tensor, bounds: torch.Tensor, reach: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From squared norms per group (G, B): the clip factors (G, B), zero for an example whose norm is not
    finite in any group (it contributes nothing), which examples are finite (B,), and the whole norms (B,).
    `reach` (G, B), squared: how far the clipped sum may carry each unclipped group, rounding included
    (≥ the norm); the factors clip it, so what is summed stays within the bound."""
    factors, finite = clip_factors((sq if reach is None else reach).sqrt(), bounds.view(-1, 1))
    finite = finite.all(0)
    return torch.where(finite, factors, torch.zeros_like(factors)), finite, sq.sum(0).sqrt()


def group_norms(layers: list, groups: int, batch_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """From [(clip group, (B,) squared norm, (B,) its reach or None)], one per layer (or parameter): the
    squared norms per group (G, B), and the same with each layer's reach in place of its norm where it
    has one (`LayerRule.reach_sq`): what its clipped sum may carry. Stacked once per group: added layer
    by layer they took ~8 kernel launches a layer, and on a GPU the clipped step is bound by its launches."""
    zero = torch.zeros(batch_size, dtype=torch.float32, device=device)  # a group without such layers
    sq, reach = [], []
    for group in range(groups):
        mine = [(s, s if r is None else r) for g, s, r in layers if g == group]
        norm_sq, reach_sq = (torch.stack(x).sum(0) for x in zip(*mine)) if mine else (zero, zero)
        sq.append(norm_sq)
        reach.append(reach_sq)
    return torch.stack(sq), torch.stack(reach)


def _bytes(r) -> int:
    """What the call's input and output gradient take, in the dtype the forward made them."""
    return sum(t.numel() * t.element_size() for t in (r.grad, r.activation) if t is not None)


def _per_example_bytes(r) -> int:
    """What the call's per-example gradients would take: fp32 floats (the rules count the floats they
    hold beyond the input and output gradient)."""
    floats = r.rule.held_if_instantiated(r.module, r.activation, r.grad)
    return 4 * (floats + sum(t.numel() for t in (r.grad, r.activation) if t is not None))


def _instantiate(r, per_module: dict) -> None:
    """Adds the call's per-example gradients into per_module[id(module)] = (module, {attr: (B, ...)})
    (a reused layer's calls summed per example) and drops its input and output gradient."""
    per = per_module.setdefault(id(r.module), (r.module, {}))[1]
    for k, v in r.rule.per_sample(r.module, r.activation, r.grad).items():
        per[k] = per[k] + v if k in per else v
    r.activation = r.grad = None  # held in `per` from here


def as_autocast_multiplies(x: torch.Tensor) -> torch.Tensor:
    """An fp32 input as a Linear under bf16 autocast multiplies it: rounded to bf16. Its weight's gradient
    is taken with that copy, so the clipper holds it (half the bytes; exact bf16 products on a GPU)."""
    device = x.device.type
    if (x.dtype == torch.float32 and torch.is_autocast_enabled(device)
            and torch.get_autocast_dtype(device) == torch.bfloat16):
        return x.bfloat16()
    return x


class _Record:
    """One call of one module: its input (activation) and, after backward, its output gradient."""

    __slots__ = ("module", "rule", "activation", "grad")

    def __init__(self, module, rule, activation):
        self.module, self.rule, self.activation, self.grad = module, rule, activation, None


def examples(batch: tuple[torch.Tensor, ...], views: int) -> int:
    """How many examples the rows of `batch` are, `views` rows each."""
    if len(batch[0]) % views:
        raise ValueError(f"{len(batch[0])} rows are not whole examples of {views} views each")
    return len(batch[0]) // views


class ClippedSum:
    """What every clipper shares: `sum` (name -> `sum_dtype` tensor), reset, the forward under autocast."""

    mode = "per_sample"
    sum_dtype = SUM_DTYPE

    def __init__(self, model: nn.Module, clip_norm: float, autocast=contextlib.nullcontext, loss_scale: float = 1.0,
                 encoder_share: float | None = None, views: int = 1):
        self.model, self.clip_norm, self.autocast, self.loss_scale = model, clip_norm, autocast, loss_scale
        if views < 1:
            raise ValueError(f"views must be at least 1, not {views}")
        self.views = views  # consecutive rows per example; its gradient is their mean
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.group_of, bounds = group_bounds(model, clip_norm, encoder_share)
        device = next(iter(self.params.values())).device if self.params else None
        self.bounds = torch.tensor(bounds, dtype=torch.float32, device=device)
        self.sum = None

    def reset(self, parts: int = 1) -> None:
        self.sum = None  # the last step's sums go before the new ones come (fp64: 8 bytes a parameter)
        self.sum = zero_sums(self.params, self.sum_dtype, parts)

    def unscaled(self, g: torch.Tensor) -> torch.Tensor:
        """g in fp32 without the fp16 loss scale (no copy of an fp32 g without one: /1 was a pass over it)."""
        return g.float() if self.loss_scale == 1 else g.float() / self.loss_scale

    def finish(self, batch_size: int) -> int:
        """After the ranks' sums are added up: per-example clippers are done (0 batches dropped)."""
        return 0


class BookKeepingClipper(ClippedSum):
    """Σ_i min(1, C/‖∇loss_i‖) ∇loss_i over micro-batches, accumulated into `self.sum`."""

    def __init__(self, model, clip_norm, ghost: bool | None = None, held_budget: float = HELD_BUDGET, **kw):
        """`ghost`: None picks per layer (the faster route, within `held_budget`); True/False force ghost
        norms on/off (for tests). `held_budget`: the bytes instantiated per-example gradients may hold
        beyond the inputs and output gradients they free, as a share of all layers' inputs and output
        gradients (which a non-private backward holds too)."""
        reject_unboundable(model, per_example_rules=True)
        super().__init__(model, clip_norm, **kw)
        self.ghost, self.held_budget = ghost, held_budget
        self._names = {id(p): n for n, p in self.params.items()}
        self._records: list[_Record] = []
        self._reduced: dict[int, tuple[nn.Module, dict[str, torch.Tensor]]] = {}  # module id -> per-example grads
        self._reduced_bytes = 0  # the inputs and output gradients those replaced (for the held budget)
        self._capturing = False
        self._group: dict[int, int] = {}  # module id -> its parameters' clip group
        for m in model.modules():
            if rule_for(m) is not None and any(p.requires_grad for p in m.parameters(recurse=False)):
                if rule_for(m).takes_low_precision:
                    m.register_forward_pre_hook(self._input_as_multiplied)
                m.register_forward_hook(self._forward_hook)
                groups = {self.group_of[id(p)] for p in m.parameters(recurse=False) if p.requires_grad}
                if len(groups) > 1:
                    raise UnboundableModel(f"{type(m).__name__} has parameters in two clip groups")
                self._group[id(m)] = groups.pop()

    def _input_as_multiplied(self, module, inputs):
        """Under bf16 autocast, hands the layer the bf16 copy of its input that autocast would make (the
        same rounding), so the forward hook holds the very tensor the product used and autograd saves:
        one cast a layer, not two, and one copy held."""
        if not self._capturing:
            return None
        cast = as_autocast_multiplies(inputs[0])
        return None if cast is inputs[0] else (cast, *inputs[1:])

    def _forward_hook(self, module, inputs, output):
        if not self._capturing:
            return None
        rule = rule_for(module)
        held = inputs[0].detach() if rule.needs_input else None  # as multiplied (_input_as_multiplied)
        record = _Record(module, rule, held)
        self._records.append(record)
        if not output.requires_grad:  # a layer fed only by data/ids: start the graph here, with a zero
            # leaf added (the output made a leaf itself would stay alive, with its .grad, to the end)
            output = output + torch.zeros((), dtype=output.dtype, device=output.device, requires_grad=True)
        output.register_hook(lambda g: self._output_grad(record, g.detach()))
        return output

    def _output_grad(self, record: _Record, g: torch.Tensor) -> None:
        record.grad = g
        if self.views > 1:  # from here on the record holds examples, not rows (views: reshapes, no copies)
            record.activation, record.grad = record.rule.group_views(record.module, record.activation, g, self.views)
        if self._reduce_now(record):
            self._reduced_bytes += _bytes(record)
            with fp32_only(g.device):
                self._instantiate(record, self._reduced)

    def _reduce_now(self, r: _Record) -> bool:
        """Instantiate inside the backward where that is the layer's route anyway and the per-example
        gradients are no larger than the output gradient alone: the input may be shared with other
        layers or saved by autograd, so dropping it need not free anything."""
        grad_bytes = r.grad.numel() * r.grad.element_size()  # bytes: bf16 gradients weigh half an fp32 one
        return self._ghost_preferred(r) is not True and _per_example_bytes(r) <= grad_bytes

    def _ghost_preferred(self, r: _Record) -> bool | None:
        """True/False: the route the layer takes whatever the memory; None: instantiating is faster."""
        if not r.rule.has_ghost or self.ghost is False:
            return False
        if self.ghost or r.rule.ghost_is_faster(r.module, r.activation, r.grad):
            return True
        return None

    def _fp32(self, r: _Record) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The call's input and output gradient in fp32 (`unscaled`), made in the layer's turn: the records keep
        the forward's dtype, so under bf16 autocast the clipper never holds every layer in fp32 at once (1.2-1.6x
        the non-private memory when it did). Upcasting is exact. On a GPU a Linear layer's bf16 records go as
        they are: its products are bf16 GEMMs with fp32 results, exact products summed in fp32 (mm32)."""
        if r.rule.takes_low_precision and self.loss_scale == 1 and layer_rules.low_gemm_applies(r.grad, r.grad):
            return r.activation, r.grad
        a = r.activation
        return (a.float() if a is not None and a.is_floating_point() else a), self.unscaled(r.grad)

    def _instantiate(self, r: _Record, per_module: dict) -> None:
        r.activation, r.grad = self._fp32(r)
        _instantiate(r, per_module)

    @contextlib.contextmanager
    def _capture(self):
        for p in self.params.values():
            p.requires_grad_(False)
        self._records, self._capturing = [], True
        self._reduced, self._reduced_bytes = {}, 0
        try:
            yield
        finally:
            self._capturing = False
            for p in self.params.values():
                p.requires_grad_(True)

    def _backward(self, batch) -> tuple[int, list[_Record]]:
        count = examples(batch, self.views)
        with self._capture():
            with self.autocast():
                losses = self.model(*batch)
            (losses.float().sum() * (self.loss_scale / self.views)).backward()
        records = [r for r in self._records if r.grad is not None]  # not reduced, and reached the loss
        self._records = []
        return count, records

    def _ghost_route(self, r: _Record, budget: list[float]) -> bool:
        """Ghost norm or instantiation for a layer called once: the faster one, if memory allows."""
        preferred = self._ghost_preferred(r)
        if preferred is not None:
            return preferred
        held = _per_example_bytes(r) - _bytes(r)
        if held > budget[0]:
            return True
        budget[0] -= max(held, 0)
        return False

    def accumulate(self, *batch: torch.Tensor) -> ClipStats:
        batch_size, records = self._backward(batch)
        device = next(iter(self.params.values())).device
        with fp32_only(device):
            calls: dict[int, list[_Record]] = {}
            for r in records:
                calls.setdefault(id(r.module), []).append(r)
            layers = []  # (clip group, (B,) squared norm, (B,) its reach or None) per layer
            budget = [self.held_budget * (self._reduced_bytes + sum(_bytes(r) for r in records))]
            reduced, self._reduced = self._reduced, {}
            for module_calls in calls.values():
                first = module_calls[0]
                if len(module_calls) == 1 and id(first.module) not in reduced and self._ghost_route(first, budget):
                    group, held = self._group[id(first.module)], self._fp32(first)
                    sq = first.rule.ghost_sq_norm(first.module, *held)
                    layers.append((group, sq, first.rule.reach_sq(first.module, *held, sq)))
                    continue
                for r in module_calls:
                    self._instantiate(r, reduced)
            instantiated = list(reduced.values())  # (module, per-example grads): cheaper, smaller, or reused
            for m, per in instantiated:  # bounded: never below the norm of what is summed (layer_rules)
                layers += [(self._group[id(m)], bounded_sq_norms(v), None) for v in per.values()]
            sq, reach = group_norms(layers, len(self.bounds), batch_size, device)
            factors, finite, norms = grouped_factors(sq, self.bounds, reach)
            all_finite = bool(finite.all())  # the usual case: no row to zero, no copies for it
            for m, per in instantiated:
                for k, v in per.items():
                    v = v if all_finite else _zero_rows(v, finite)
                    self.sum[self._names[id(getattr(m, k))]] += torch.einsum("b,b...->...", factors[self._group[id(m)]], v)
            done = {id(m) for m, _ in instantiated}
            for r in records:
                if id(r.module) in done:
                    continue
                activation, grad = self._fp32(r)
                r.activation = r.grad = None  # the layer is done: its memory goes as the next one's comes
                if not all_finite:
                    grad = _zero_rows(grad, finite)
                    if activation is not None and activation.is_floating_point():
                        activation = _zero_rows(activation, finite)  # 0·NaN would still be NaN
                for k, v in r.rule.clipped_sum(r.module, activation, grad, factors[self._group[id(r.module)]]).items():
                    self.sum[self._names[id(getattr(r.module, k))]] += v
        return ClipStats(norms.tolist(), int((~finite).sum()))


class VmapClipper(ClippedSum):
    """Reference engine: per-example gradients from torch.func (vmap of grad over single examples).
    Exact for any layer but slower and O(B·params) in memory."""

    def __init__(self, model: nn.Module, clip_norm: float, **kw):
        reject_unboundable(model, per_example_rules=False)
        super().__init__(model, clip_norm, **kw)

        def loss_one(params, buffers, *rows):  # one example's rows: its views
            with self.autocast():
                loss = functional_call(model, (params, buffers), rows).mean()
            return loss.float() * self.loss_scale

        self._grad_one = grad(loss_one)

    def accumulate(self, *batch: torch.Tensor) -> ClipStats:
        params = {n: p.detach() for n, p in self.params.items()}
        per_example = tuple(x.reshape(examples(batch, self.views), self.views, *x.shape[1:]) for x in batch)
        grads = vmap(self._grad_one, in_dims=(None, None) + (0,) * len(batch))(
            params, dict(self.model.named_buffers()), *per_example)
        device = next(iter(params.values())).device
        with fp32_only(device):
            grads = {n: self.unscaled(g) for n, g in grads.items()}
            sq = torch.zeros(len(self.bounds), len(per_example[0]), dtype=torch.float32, device=device)
            for n, g in grads.items():
                sq[self.group_of[id(self.params[n])]] += bounded_sq_norms(g)
            factors, finite, norms = grouped_factors(sq, self.bounds)
            for n, g in grads.items():
                self.sum[n] += torch.einsum("b,b...->...", factors[self.group_of[id(self.params[n])]],
                                            _zero_rows(g, finite))
        return ClipStats(norms.tolist(), int((~finite).sum()))


class PerBatchClipper(ClippedSum):
    """For batch-coupled losses (CLIP): the gradient of the logical batch's mean loss, clipped to C
    once. `accumulate` adds this rank's part of ∇Σ_i loss_i (the model all-gathers what couples the
    examples, with gradient, through `gather`), the engine sums the parts over ranks, and `finish`
    divides by the batch size and clips the total: C bounds the whole batch, whatever the world size."""

    mode = "per_batch"
    sum_dtype = torch.float32  # the one clip after the sum bounds whatever the sum rounded to

    def __init__(self, model: nn.Module, clip_norm: float, gather=None, **kw):
        reject_unboundable(model, per_example_rules=False, per_example=False)  # the batch is coupled anyway
        super().__init__(model, clip_norm, **kw)
        if self.views > 1:
            raise ValueError("per-batch clipping has no per-example gradient to average mask views in")
        self.gather = gather

    def accumulate(self, *batch: torch.Tensor) -> ClipStats:
        with self.autocast():
            losses = self.model(*batch, gather=self.gather)
        grads = torch.autograd.grad(losses.float().sum() * self.loss_scale, list(self.params.values()),
                                    allow_unused=True)
        with fp32_only(losses.device):
            for n, g in zip(self.params, grads):
                if g is not None:
                    self.sum[n] += self.unscaled(g)
        return ClipStats([])

    def finish(self, batch_size: int) -> int:
        if batch_size == 0:
            return 0
        device = next(iter(self.sum.values())).device
        with fp32_only(device):
            sq = torch.zeros(len(self.bounds), dtype=torch.float32, device=device)  # of the summed gradient, per group
            for n, v in self.sum.items():  # never read low: a sum clipped by a low norm carries more than C
                sq[self.group_of[id(self.params[n])]] += bounded_sq_norms(v.reshape(1, -1))[0]
            factors, finite = clip_factors(sq.sqrt() / batch_size, self.bounds)  # the batch mean's norms
            finite = finite.all()
            for n, v in self.sum.items():
                scale = factors[self.group_of[id(self.params[n])]] / batch_size
                v.copy_(torch.where(finite, v * scale, torch.zeros_like(v)))  # 0·NaN would still be NaN
        return int(~finite)


class PlainSum(ClippedSum):
    """Σ_i ∇loss_i with no clipping: the non-private baseline of a per-example recipe (never DP)."""
    sum_dtype = torch.float32

    def accumulate(self, *batch: torch.Tensor) -> ClipStats:
        examples(batch, self.views)
        with self.autocast():
            losses = self.model(*batch)
        grads = torch.autograd.grad(losses.float().sum() * (self.loss_scale / self.views), list(self.params.values()),
                                    allow_unused=True)
        for n, g in zip(self.params, grads):
            if g is not None:
                self.sum[n] += self.unscaled(g)
        return ClipStats([])
