"""AdamW for bfloat16 weights, with the update written back by stochastic rounding.

A bfloat16 weight keeps 8 significant bits: near |w| = 0.02 its spacing is 1.2e-4, so an AdamW step of lr = 1e-6
(the usual DPO learning rate) is below half a spacing and round-to-nearest drops it; torch.optim.AdamW on bfloat16
parameters applies under 1 % of the intended change at that rate, and norm weights (≈ 1.0) never move. Here every
step is computed in float32 from the bfloat16 weight, gradient and moments, and the new weight is rounded up or down
at random with the probabilities that make its expectation exact: small updates accumulate on average, with no
float32 master copy in memory. Moments stay in the parameter's dtype, as torch.optim.AdamW keeps them, so memory is
the same. Parameters of other dtypes get the same float32 update, rounded to nearest.

Works on plain tensors and on FSDP2's sharded DTensor parameters (the update runs on each rank's local shard).
On CUDA with Triton, the update of all tensors is one kernel launch (`fastdpo.kernels.adamw`, one read and one write
of each tensor); elsewhere it is the float32 foreach computation below, in slices of at most CHUNK elements.
State keys (`step`, `exp_avg`, `exp_avg_sq`) match torch.optim.AdamW, so checkpoints load either way.
"""

from __future__ import annotations

import math

import torch

CHUNK = 1 << 25  # elements per group of float32 temporaries (4 of them: ≈ 512 MiB at most)


def _kernel():
    """fastdpo.kernels.adamw's update function, or None where Triton is not installed."""
    try:
        from fastdpo.kernels.adamw import adamw_update_
    except ImportError:
        return None
    return adamw_update_


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """dst (bfloat16) <- src (float32), rounded to one of the two nearest bfloat16 values with probability
    proportional to closeness, so that E[dst] = src. Adds 16 random low bits to the float32 pattern and truncates."""
    bits = src.view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    rounded = (bits + noise).bitwise_and_(-65536).view(torch.float32)
    dst.copy_(rounded)  # exact: the low 16 bits are zero


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The tensor to compute on: a DTensor's local shard (the tensor it holds, so in-place ops change the DTensor),
    else the tensor itself. Read as the attribute: `to_local()` goes through an autograd function and DTensor's
    dispatch, ≈ 20 µs of host time each, and the update and the clipping ask for every parameter's shards each step."""
    inner = getattr(t, "_local_tensor", None)
    if inner is not None:
        return inner
    return t.to_local() if hasattr(t, "to_local") else t


def _pieces(tensors: list[list[torch.Tensor]]) -> list[list[list[torch.Tensor]]]:
    """Split aligned lists of tensors (parameter, gradient, moments) into groups of flat slices of at most CHUNK
    elements in all, so the float32 temporaries stay small whatever the largest parameter (an embedding)."""
    groups, current, size = [], [[] for _ in tensors], 0
    for aligned in zip(*tensors):
        if not all(t.is_contiguous() for t in aligned):  # cannot be sliced in place: one piece, as it is
            groups.append([[t] for t in aligned])
            continue
        flat = [t.view(-1) for t in aligned]
        n = flat[0].numel()
        for start in range(0, n, CHUNK):
            end = min(n, start + CHUNK)
            if size and size + (end - start) > CHUNK:
                groups.append(current)
                current, size = [[] for _ in tensors], 0
            for lst, f in zip(current, flat):
                lst.append(f[start:end])
            size += end - start
    if size:
        groups.append(current)
    return groups


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, bias correction), computed in float32 and written to
    bfloat16 parameters with stochastic rounding. The rounding noise of each step is drawn from a generator seeded
    with (`seed`, step, parameter group): identical on every rank, so DDP replicas stay equal, and a resumed run
    rounds as the uninterrupted one would."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._fused = None  # the Triton update, looked up on the first CUDA step
        self._counted: list[dict] = []  # the states whose step count the last step() advanced
        self._ones: dict[tuple, torch.Tensor] = {}  # (device, dtype) -> a constant one-element true or 1.0

    def _seed(self, step: int, group: int) -> int:
        return ((self.seed * 1_000_003 + step) * 1_009 + group) % (1 << 62)

    def _generator(self, device: torch.device, step: int, group: int) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        g = self._generators[device]
        g.manual_seed(self._seed(step, group))
        return g

    @torch.no_grad()
    def step(self, closure=None, finite: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None):
        """One update. `finite`: a one-element bool tensor; where it is false the weights and moments are left as
        they are. The CUDA kernel reads it on the device, so the host need not wait for the gradients to decide;
        the other path reads it here. Either way the host-side step counts advance: once the caller has read the
        flag, `rewind()` takes a skipped step's counts back. `grad_scale`: a one-element tensor the gradients are
        multiplied by, in float32, as the update reads them (clipping's coefficient, `collectives.clip_coef`); the
        gradients themselves are left as they are."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._counted = []
        for index, group in enumerate(self.param_groups):
            by_kind: dict[tuple, list[list]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if state["step"].device.type != "cpu":  # loaded from a fused AdamW's state: keep the count on
                    state["step"] = state["step"].cpu()  # the host, so reading it costs no device sync
                state["step"] += 1
                self._counted.append(state)
                step = int(state["step"].item())
                lp = local_shard(p)
                tensors = (lp, local_shard(p.grad), local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"]))
                fused = lp.device.type == "cuda" and all(t.is_contiguous() for t in tensors) and self._fused_update()
                kind = (step, lp.device, tuple(t.dtype for t in tensors), bool(fused))
                lists = by_kind.setdefault(kind, [[], [], [], [], []])
                for lst, t in zip(lists, tensors):
                    lst.append(t)
                lists[4].append(_shard_rank(p))
            for (step, device, dtypes, fused), lists in by_kind.items():
                dtype = dtypes[0]
                if fused:
                    ok = self._scalar(finite, device, torch.bool)
                    scale = self._scalar(grad_scale, device, torch.float32)
                    self._fused_steps(lists, group, step, index, dtype == torch.bfloat16, ok, scale)
                elif finite is None or bool(finite):
                    gen = self._generator(device, step, index) if dtype == torch.bfloat16 else None
                    scale = None if grad_scale is None else grad_scale.reshape(()).to(device, torch.float32)
                    _foreach_steps(lists[:4], group, step, gen, scale)
        return loss

    def rewind(self) -> None:
        """Take back the step counts of the last `step()`, whose update the `finite` flag skipped."""
        for state in self._counted:
            state["step"] -= 1
        self._counted = []

    def _scalar(self, given: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A one-element tensor the kernel reads on `device`: `given` (the finite flag, the gradients' scale) in
        `dtype`, or a constant one (true, 1.0) when there is none."""
        if given is not None:
            return given.reshape(1).to(device, dtype, non_blocking=True)
        if (device, dtype) not in self._ones:
            self._ones[device, dtype] = torch.ones(1, dtype=dtype, device=device)
        return self._ones[device, dtype]

    def _fused_update(self):
        if self._fused is None:
            self._fused = _kernel() or False
        return self._fused or None

    def _fused_steps(self, lists: list[list], group: dict, step: int, index: int, stochastic: bool,
                     ok: torch.Tensor, scale: torch.Tensor) -> None:
        """One kernel launch for all the tensors. The noise seed of tensor k is derived from (seed, step, group, k)
        and, for a DTensor shard, its rank (replicated tensors: the same seed on every rank)."""
        base = self._seed(step, index)
        b1, b2 = group["betas"]
        seeds = [((base * 31 + k) * 131 + shard) % ((1 << 31) - 1) for k, shard in enumerate(lists[4])]
        self._fused(*lists[:4], ok, lr=group["lr"], weight_decay=group["weight_decay"], b1=b1, b2=b2, step=step,
                    eps=group["eps"], seeds=seeds, stochastic=stochastic, scale=scale)


def _shard_rank(p: torch.Tensor) -> int:
    """A DTensor parameter's rank in its mesh (+1), 0 for a plain tensor."""
    mesh = getattr(p, "device_mesh", None)
    return mesh.get_rank() + 1 if mesh is not None else 0


def _foreach_steps(lists: list[list[torch.Tensor]], group: dict, step: int, gen: torch.Generator | None,
                   scale: torch.Tensor | None = None) -> None:
    """The update in float32 foreach ops, slice group by slice group; bfloat16 weights rounded stochastically
    with `gen`, others to nearest; the gradients multiplied by `scale` (float32, 0-d) as they are read."""
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    c1 = 1 - b1**step
    c2 = 1 - b2**step
    for w, g, m, v in _pieces(lists):
        w32 = [t.float() for t in w]
        g32 = [t.float() for t in g]
        if scale is not None:  # out of place: a float32 gradient's float() is the gradient itself
            g32 = torch._foreach_mul(g32, scale)
        m32 = [t.float() for t in m]
        v32 = [t.float() for t in v]
        if wd:
            torch._foreach_mul_(w32, 1 - lr * wd)
        torch._foreach_lerp_(m32, g32, 1 - b1)
        torch._foreach_mul_(v32, b2)
        torch._foreach_addcmul_(v32, g32, g32, 1 - b2)
        denom = torch._foreach_sqrt(v32)
        torch._foreach_div_(denom, math.sqrt(c2))
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(w32, m32, denom, -lr / c1)
        for dst, src in zip(m, m32):
            dst.copy_(src)
        for dst, src in zip(v, v32):
            dst.copy_(src)
        for dst, src in zip(w, w32):
            if dst.dtype == torch.bfloat16:
                stochastic_round_(dst, src, gen)
            else:
                dst.copy_(src)
