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
a Poisson batch) adds a slice of them, and its batch dimension is left dynamic: one more graph, not
one per size.

What it costs: the LayerNorms' per-example gradients are formed after the backward, not inside it,
so their inputs and output gradients are held to the end (1.2-1.3× the non-private memory on the
CPU recipe's models, against about 1.05× eager).
"""

from __future__ import annotations

import torch

from pipeline.privacy.clipping import BookKeepingClipper, _Record, examples
from pipeline.privacy.layer_rules import rule_for


class CompiledBookKeepingClipper(BookKeepingClipper):
    """`BookKeepingClipper` whose records survive `model.compile()` as one graph (module docstring)."""

    def __init__(self, model, clip_norm, **kw):
        super().__init__(model, clip_norm, **kw)
        self._layouts: dict[tuple, list[tuple[torch.nn.Module, tuple[int, ...], torch.dtype]]] = {}
        self._layout: list | None = None  # the current batch shape's calls: (module, output tail, dtype)
        self._found: list | None = None   # filled by the hook while a layout is being found
        self._probes: dict[tuple, list[torch.Tensor]] = {}  # (batch shape, rows) -> one probe per call
        self._probe_set: list[torch.Tensor] = []  # this micro-batch's probes
        self._inputs: list[torch.Tensor | None] = []  # this micro-batch's slots
        self._next = 0

    def _forward_hook(self, module, inputs, output):
        if not self._capturing:
            return None
        if self._found is not None:
            self._found.append((module, tuple(output.shape), output.dtype))
            return None
        i = self._next
        if i >= len(self._layout) or self._layout[i][0] is not module or tuple(output.shape[1:]) != self._layout[i][1]:
            raise RuntimeError(f"dp.compile: call {i} of the clipped layers ({type(module).__name__}, output "
                               f"{tuple(output.shape)}) is not the one its slot was laid out for")
        self._next = i + 1
        self._inputs[i] = inputs[0].detach() if rule_for(module).needs_input else None
        probe = self._probe_set[i]
        return output + (probe if probe.shape[0] == output.shape[0] else probe[:output.shape[0]])

    def _find_layout(self, batch) -> list:
        """The clipped calls of one forward, in order, with their outputs' shapes past the batch
        dimension: from eager forwards of one and of two examples, which must agree."""
        found = []
        for count in (1, 2):
            self._found = []
            try:  # a forked generator: a model drawing at random inside draws the same as without these
                with (torch.random.fork_rng(devices=[batch[0].device] if batch[0].is_cuda else []), self._capture(),
                      torch.no_grad(), self.autocast()):  # .forward: eager, not the compiled call
                    self.model.forward(*(t[:count * self.views] for t in batch))
                found.append(self._found)
            finally:
                self._found = None
        one, two = found
        if len(one) != len(two):
            raise ValueError(f"dp.compile: the model makes {len(one)} clipped calls for one example and {len(two)} for "
                             "two: its records need the eager clipper (dp.compile=false)")
        layout = []
        for (module, s1, dtype), (other, s2, _) in zip(one, two):
            if other is not module or s1[1:] != s2[1:] or (s1[0], s2[0]) != (self.views, 2 * self.views):
                raise ValueError(f"dp.compile: {type(module).__name__}'s output {s1} (one example) / {s2} (two) does "
                                 "not lead with the batch: its records need the eager clipper (dp.compile=false)")
            layout.append((module, s1[1:], dtype))
        return layout

    def _probes_for(self, key: tuple, rows: int, device) -> list[torch.Tensor]:
        """Zero-stride leaves, one per call, for micro-batches of up to `rows` rows (kept: they hold one
        float each, and reusing them keeps the compiled graph's inputs alike from step to step)."""
        sized = [k for k in self._probes if k[0] == key and k[1] >= rows]
        if sized:
            return self._probes[max(sized, key=lambda k: k[1])]
        probes = []
        for _, tail, dtype in self._layout:
            shape = (rows, *tail)
            probes.append(torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device=device).zero_()
                          .requires_grad_())
        self._probes[(key, rows)] = probes
        return probes

    def _backward(self, batch) -> tuple[int, list[_Record]]:
        count, rows = examples(batch, self.views), len(batch[0])
        key = tuple((tuple(t.shape[1:]), t.dtype) for t in batch)
        if key not in self._layouts:
            self._layouts[key] = self._find_layout(batch)
        self._layout = self._layouts[key]
        device = batch[0].device
        self._probe_set = self._probes_for(key, rows, device)
        if self._probe_set and rows < len(self._probe_set[0]):  # the last micro-batch of a Poisson batch
            for t in batch:  # has any size: one more graph for all of them, not one per size
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
        inputs, self._inputs, self._probe_set, grads = self._inputs, [], [], list(grads)
        records = []
        for i, (module, _, _) in enumerate(self._layout):
            if grads[i] is None:  # the output does not reach the loss: no gradient, nothing to clip
                continue
            record = _Record(module, rule_for(module), inputs[i])
            g, grads[i], inputs[i] = grads[i][:rows].detach(), None, None  # a layer reduced now frees its own
            self._output_grad(record, g)
            if record.grad is not None:  # else reduced to its per-example gradients already
                records.append(record)
        return count, records
