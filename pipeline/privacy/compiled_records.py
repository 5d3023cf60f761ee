"""Book-keeping under `dp.compile`: each layer's input and output gradient taken without the Python
hooks that stop torch.compile.

`BookKeepingClipper` keeps a layer's output gradient with a tensor hook registered in its forward hook:
inside a compiled forward that is a graph break at every clipped layer, and its record list, growing a
layer at a time, made Dynamo recompile at each length until it gave up, so the compiled clipped step
was the eager one (docs/results.md, "dp.compile on the GPU"). Here the forward hook does only what
traces into one graph:

- it writes the layer's input into a fixed slot (a list sized once, indexed by call order), and
- it adds a *probe* to the layer's output: a leaf of the output's shape with every stride 0 (one float
  of storage, value 0), so the output is unchanged.

After the forward, `torch.autograd.grad(loss, probes)` returns each probe's gradient, which is the
layer's full output gradient: the same tensors the tensor hooks held, so the norms, clip factors and
clipped sums that follow are `BookKeepingClipper`'s own code and numbers.

The slots' layout (which module each call is, its output's shape past the batch dimension) is found
once per shape of the batch's inputs by an eager forward of one and two examples; every call must
then come in that order with that shape, or the step stops (a wrong pairing of inputs and gradients
would misreport norms). Probes are sized for the largest micro-batch seen; a smaller one (the last of
a bucket of the Poisson batch: sampling.split_by_index) adds a slice of them, and its batch dimension
is left dynamic: one more graph, not one per size.

A layer that the eager clipper reduces to its per-example gradients inside the backward (every
LayerNorm, and any layer whose per-example gradients take no more bytes than its output gradient:
`BookKeepingClipper._reduce_now`) is reduced inside the compiled backward too: its output passes
through `_ReducedInBackward`, whose backward forms the per-example gradients with the eager code and
hands them back, packed, as the gradient of a probe shaped like them. Held to the end instead, the
LayerNorms' records took the compiled MAE's clipped step from 1.01× to 1.23× the compiled non-private
memory (docs/results.md, "DP overhead").
"""

from __future__ import annotations

import gc
import math
from typing import NamedTuple

import torch
import torch.nn as nn

from pipeline.privacy.clipping import BookKeepingClipper, _bytes, _Record, examples, fp32_only
from pipeline.privacy.layer_rules import rule_for


class Slot(NamedTuple):
    """One clipped call of the forward, as the layout found it."""

    module: nn.Module
    tail: tuple[int, ...]  # the output's shape past the batch dimension
    dtype: torch.dtype     # the probe's: the output's, or a reduced layer's per-example gradients'
    reduced: tuple[tuple[str, torch.Size], ...] | None  # reduced inside the backward: its parameters' shapes
    bytes_per_example: int  # reduced: what its input and output gradient took (the held budget counts it)


class _ReducedInBackward(torch.autograd.Function):
    """Identity on a layer's output; its backward passes the output gradient on and gives the layer's
    per-example gradients (the clipper's eager code: `_per_example_now`), packed (examples, P), as the
    probe's gradient."""

    @staticmethod
    def forward(ctx, output, held, probe, clipper, module):
        ctx.save_for_backward(held)
        ctx.clipper, ctx.module = clipper, module
        return output.clone()

    @staticmethod
    def backward(ctx, g):
        (held,) = ctx.saved_tensors
        per = ctx.clipper._per_example_now(ctx.module, held, g)
        return g, None, torch.cat([v.reshape(len(v), -1) for v in per.values()], 1), None, None


class CompiledBookKeepingClipper(BookKeepingClipper):
    """`BookKeepingClipper` whose records survive `model.compile()` as one graph (module docstring)."""

    def __init__(self, model, clip_norm, **kw):
        super().__init__(model, clip_norm, **kw)
        self._layouts: dict[tuple, list[Slot]] = {}  # per shape of the batch's inputs
        self._layout: list[Slot] = []  # this micro-batch's
        self._found: list | None = None  # filled by the hook while a layout is being found
        self._probes: dict[tuple, list[torch.Tensor]] = {}  # (batch shape, rows) -> one probe per call
        self._probe_set: list[torch.Tensor] = []  # this micro-batch's probes
        self._inputs: list[torch.Tensor | None] = []  # this micro-batch's slots
        self._next = 0
        self._traced: set[tuple] = set()  # (input shapes, probe rows, dynamic): a graph Dynamo traced

    def _forward_hook(self, module, inputs, output):
        if not self._capturing:
            return None
        held = inputs[0].detach() if rule_for(module).needs_input else None
        if self._found is not None:
            self._found.append((module, held, output.detach()))
            return None
        i = self._next
        slot = self._layout[i] if i < len(self._layout) else None
        if slot is None or slot.module is not module or tuple(output.shape[1:]) != slot.tail:
            # Not the output's first size: the rows of a micro-batch, which follow the realised batch size.
            tail = ", ".join(map(str, output.shape[1:]))
            raise RuntimeError(f"dp.compile: call {i} of the clipped layers ({type(module).__name__}, output "
                               f"(rows, {tail})) is not the one its slot was laid out for")
        self._next = i + 1
        probe = self._probe_set[i]
        rows = output.shape[0] // self.views if slot.reduced else output.shape[0]
        probe = probe if probe.shape[0] == rows else probe[:rows]
        if slot.reduced:
            return _ReducedInBackward.apply(output, held, probe, self, module)
        self._inputs[i] = held
        return output + probe

    def _example_record(self, module, held, g) -> _Record:
        """A call's record with each example's views made one example, as `_output_grad` makes it."""
        record = _Record(module, rule_for(module), held)
        record.grad = g
        if self.views > 1:
            record.activation, record.grad = record.rule.group_views(module, held, g, self.views)
        return record

    def _per_example_now(self, module, held, g) -> dict[str, torch.Tensor]:
        """The per-example gradients the eager clipper forms inside the backward (`_output_grad`)."""
        record = self._example_record(module, held, g)
        per_module = {}
        with fp32_only(g.device):
            self._instantiate(record, per_module)
        return per_module[id(module)][1]

    def _find_layout(self, batch) -> list[Slot]:
        """The clipped calls of one forward, in order, with their outputs' shapes past the batch
        dimension: from eager forwards of one and of two examples, which must agree. Both are the
        batch's first example (repeated): a micro-batch may hold only one."""
        found = []
        for count in (1, 2):
            self._found = []
            try:  # a forked generator: a model drawing at random inside draws the same as without these
                with (torch.random.fork_rng(devices=[batch[0].device] if batch[0].is_cuda else []), self._capture(),
                      torch.no_grad(), self.autocast()):  # .forward: eager, not the compiled call
                    self.model.forward(*(t[:self.views].repeat(count, *[1] * (t.dim() - 1)) for t in batch))
                found.append(self._found)
            finally:
                self._found = None
        one, two = found
        if len(one) != len(two):
            raise ValueError(f"dp.compile: the model makes {len(one)} clipped calls for one example and {len(two)} for "
                             "two: its records need the eager clipper (dp.compile=false)")
        return [self._slot(first, second) for first, second in zip(one, two)]

    def _slot(self, first, second) -> Slot:
        """The slot of one call, from its records at one and at two examples; reduced inside the
        backward where the eager clipper would reduce it (decided on the two examples' shapes)."""
        (module, _, s1), (other, held, out) = first, second
        if other is not module or s1.shape[1:] != out.shape[1:] or (len(s1), len(out)) != (self.views, 2 * self.views):
            raise ValueError(f"dp.compile: {type(module).__name__}'s output {tuple(s1.shape)} (one example) / "
                             f"{tuple(out.shape)} (two) does not lead with the batch: its records need the eager "
                             "clipper (dp.compile=false)")
        record = self._example_record(module, held, out)  # out: its output gradient's shape and dtype
        if not self._reduce_now(record):
            return Slot(module, tuple(out.shape[1:]), out.dtype, None, 0)
        per = self._per_example_now(module, held, out)
        return Slot(module, tuple(out.shape[1:]), next(iter(per.values())).dtype,
                    tuple((k, v.shape[1:]) for k, v in per.items()), _bytes(record) // 2)

    def _probes_for(self, key: tuple, rows: int, device) -> tuple[int, list[torch.Tensor]]:
        """(up to how many rows, zero-stride leaves, one per call): kept, since they hold one float
        each and reusing them keeps the compiled graph's inputs alike from step to step."""
        sized = [k for k in self._probes if k[0] == key and k[1] >= rows]
        if sized:
            largest = max(sized, key=lambda k: k[1])
            return largest[1], self._probes[largest]
        probes = []
        for slot in self._layout:
            shape = ((rows // self.views, sum(math.prod(s) for _, s in slot.reduced)) if slot.reduced
                     else (rows, *slot.tail))
            probes.append(torch.empty_strided(shape, (0,) * len(shape), dtype=slot.dtype, device=device).zero_()
                          .requires_grad_())
        self._probes[(key, rows)] = probes
        return rows, probes

    def _backward(self, batch) -> tuple[int, list[_Record]]:
        count, rows = examples(batch, self.views), len(batch[0])
        key = tuple((tuple(t.shape[1:]), t.dtype) for t in batch)
        if key not in self._layouts:
            self._layouts[key] = self._find_layout(batch)
        self._layout = self._layouts[key]
        capacity, self._probe_set = self._probes_for(key, rows, batch[0].device)
        if rows < capacity:  # a bucket's last micro-batch has any size: one more graph for
            for t in batch:  # all of them, not one per size
                torch._dynamo.maybe_mark_dynamic(t, 0)
        self._inputs = [None] * len(self._layout)
        with self._capture():
            self._next = 0
            with self.autocast():
                losses = self.model(*batch)
            if self._next != len(self._layout):
                raise RuntimeError(f"dp.compile: the forward made {self._next} clipped calls, its layout "
                                   f"{len(self._layout)}")
            grads = torch.autograd.grad(losses.float().sum() * (self.loss_scale / self.views), self._probe_set,
                                        allow_unused=True)
            if (key, capacity, rows < capacity) not in self._traced:
                # Dynamo's tracer state is left in reference cycles holding what the hook read as it
                # traced, this clipper's sum buffers among them (a copy of the parameters), until a full
                # collection; graphs loaded from Inductor's cache make too few objects to trigger one
                # (the compiled MAE's clipped step held 1.32x the non-private memory, not 1.01x).
                self._traced.add((key, capacity, rows < capacity))
                gc.collect()
            inputs, self._inputs, self._probe_set, grads = self._inputs, [], [], list(grads)
            records = []
            for i, slot in enumerate(self._layout):
                if grads[i] is None:  # the output does not reach the loss: no gradient, nothing to clip
                    continue
                g, grads[i] = grads[i], None
                if slot.reduced:  # as the eager clipper's `_instantiate`: a reused layer's calls summed
                    per = self._reduced.setdefault(id(slot.module), (slot.module, {}))[1]
                    for (k, shape), v in zip(slot.reduced, g[:count].split([math.prod(s) for _, s in slot.reduced], 1)):
                        v = v.reshape(count, *shape)
                        per[k] = per[k] + v if k in per else v
                    self._reduced_bytes += count * slot.bytes_per_example
                    continue
                record = _Record(slot.module, rule_for(slot.module), inputs[i])
                inputs[i] = None
                self._output_grad(record, g[:rows].detach())
                if record.grad is not None:  # else reduced to its per-example gradients already
                    records.append(record)
        return count, records
