"""``optim.fused_update``: AdamW on fp32 masters in one kernel that reads the bf16 gradients and
writes the bf16 weights.

Why: with ``trainer.param_dtype=bf16`` the unfused update makes three passes over every trainable
parameter: the bf16 gradients are copied into fp32 master gradients, torch's fused AdamW updates
the masters and their moments, and the masters are rounded into the bf16 weights. That is about
40 bytes of memory traffic a parameter (plus a 4 B/param fp32 gradient buffer); one kernel doing
all three needs 30 (read: bf16 gradient, master, two moments; write: those three and the bf16
weight). On a kernel-bound step (a 1.5B-parameter Whisper, a 2B GLM-ASR with CUDA graphs) the
update is 10-20% of the step.

How: one Triton launch per parameter group covers every tensor of the group. A table gives each
program its tensor and offset, and the tensors' addresses (gradient, master, moments, weight, step
count) are read from a small int64 table rebuilt every step, so gradients may be freed and remade
between steps, and a resume may replace the state tensors. The optimizer's own state is what the
kernel updates (``exp_avg``, ``exp_avg_sq``, ``step``, as torch's fused AdamW keeps them), so
checkpoints, exact resume and ``optim.fused_update=false`` read the same state.

Tensors the kernel does not take (fp32 parameters kept fp32, non-contiguous or unaligned tensors,
any tensor on the CPU) go through the unfused path, torch's ``_fused_adamw_`` on an fp32
gradient, inside the same call; so does everything on the CPU (the tests also run the kernel
there, in Triton's interpreter).

``auto`` (the default) turns it on wherever it applies: a GPU with Triton, the fp32 masters of a
bf16 model updated on the device by a plain AdamW with its fused kernels
(``ddptrain.update.choose.fused_kernel_serves``).
"""

from __future__ import annotations

import contextlib
import importlib.util  # noqa: F401  (choose.fused_kernel_serves reads Triton through it; the tests patch it here)
import os
from typing import Optional

import torch

from ddptrain.config import ConfigError
from ddptrain.optim import skips_on_device
from ddptrain.precision import MasterWeights
from ddptrain.update.choose import fused_kernel_serves

_BLOCK = 4096  # elements per Triton program: a few MB per thousand programs, grids of ~10^5 at 1B params


def _triton_kernel():
    """The kernel, compiled on first use (Triton is imported only when a CUDA update runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_masters(ptrs, numels, block_tensor, block_start, found_inf, factor, n_tensors,
                      lr, beta1, beta2, eps, weight_decay, BLOCK: tl.constexpr):
        if tl.load(found_inf) != 0:
            return  # a non-finite step: weights, moments (and, by the caller, step counts) unchanged
        pid = tl.program_id(0)
        t = tl.load(block_tensor + pid)
        start = tl.load(block_start + pid).to(tl.int64)
        n = tl.load(numels + t)
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        # tensor addresses read from memory: the caller checked they are 16-byte aligned, and a
        # full block needs no mask, so its loads and stores are vectorised
        grad = tl.load(ptrs + t).to(tl.pointer_type(tl.bfloat16))
        master = tl.load(ptrs + n_tensors + t).to(tl.pointer_type(tl.float32))
        exp_avg = tl.load(ptrs + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
        exp_avg_sq = tl.load(ptrs + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))
        weight = tl.load(ptrs + 4 * n_tensors + t).to(tl.pointer_type(tl.bfloat16))
        step = tl.load(tl.load(ptrs + 5 * n_tensors + t).to(tl.pointer_type(tl.float32)))
        g_at = tl.multiple_of(grad + offs, 16)
        w_at = tl.multiple_of(master + offs, 16)
        m_at = tl.multiple_of(exp_avg + offs, 16)
        v_at = tl.multiple_of(exp_avg_sq + offs, 16)
        p_at = tl.multiple_of(weight + offs, 16)
        full = start + BLOCK <= n
        if full:
            g, w = tl.load(g_at).to(tl.float32), tl.load(w_at)
            m, v = tl.load(m_at), tl.load(v_at)
        else:
            g, w = tl.load(g_at, mask=mask, other=0.0).to(tl.float32), tl.load(w_at, mask=mask, other=0.0)
            m, v = tl.load(m_at, mask=mask, other=0.0), tl.load(v_at, mask=mask, other=0.0)
        g = g * tl.load(factor)
        w = w * (1.0 - lr * weight_decay)
        m = m + (1.0 - beta1) * (g - m)  # torch's lerp
        v = beta2 * v + (1.0 - beta2) * g * g
        bias1 = 1.0 - tl.exp2(step * tl.log2(beta1))
        bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
        w = w - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
        if full:
            tl.store(w_at, w)
            tl.store(m_at, m)
            tl.store(v_at, v)
            tl.store(p_at, w.to(tl.bfloat16))
        else:
            tl.store(w_at, w, mask=mask)
            tl.store(m_at, m, mask=mask)
            tl.store(v_at, v, mask=mask)
            tl.store(p_at, w.to(tl.bfloat16), mask=mask)

    return adamw_masters


def refusal_for(optimizer: torch.optim.Optimizer, master) -> Optional[str]:
    """Why this update cannot stand for ``optimizer`` over ``master``, or None if it can."""
    if not isinstance(master, MasterWeights) or master.sharded:
        return ("optim.fused_update=true needs the fp32 masters of trainer.param_dtype=bf16, "
                "on the training device and not sharded (optim.zero=false, optim.offload=none)")
    if type(optimizer) is not torch.optim.AdamW:
        return (f"optim.fused_update=true runs AdamW's update; the optimizer is a "
                f"{type(optimizer).__name__} (set optim.name=adamw, optim.zero=false)")
    if any(g.get("amsgrad") or g.get("maximize") or g.get("differentiable") for g in optimizer.param_groups):
        return "optim.fused_update=true does not run AdamW's amsgrad, maximize or differentiable modes"
    return None


def for_run(mode, optimizer: torch.optim.Optimizer, master, device: torch.device) -> Optional["FusedMasterAdamW"]:
    """``optim.fused_update`` over given objects (the Trainer's backend decides through
    :func:`ddptrain.update.choose.choose`): ``true`` builds it (a ConfigError where it does not
    apply), ``auto`` builds it where :func:`fused_kernel_serves`, ``false`` never."""
    stands = refusal_for(optimizer, master) is None
    if not fused_kernel_serves(mode, stands, skips_on_device(optimizer), stands, device.type == "cuda"):
        return None
    return FusedMasterAdamW(optimizer, master)


class FusedMasterAdamW:
    """Runs the update of :class:`torch.optim.AdamW` over :class:`ddptrain.precision.MasterWeights`.

    Args:
        optimizer: a plain ``torch.optim.AdamW`` over the masters (not ZeRO; no amsgrad, maximize).
        master: the run's ``MasterWeights``.

    Raises:
        ConfigError: an optimizer this update does not stand for, or no masters.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, master):
        refusal = refusal_for(optimizer, master)
        if refusal:
            raise ConfigError(refusal)
        self.optimizer = optimizer
        self.model_of = {id(m): p for p, m in master.pairs}
        self._blocks: dict[tuple, tuple] = {}  # numels of a group's kernel tensors -> its program table
        self._kernel = None
        # Triton's interpreter (TRITON_INTERPRET=1, read when Triton is imported) runs the kernel on
        # CPU tensors: the tests check it there
        self.kernel_devices = {"cuda", "cpu"} if os.environ.get("TRITON_INTERPRET") == "1" else {"cuda"}

    @torch.no_grad()
    def step(self, factor: torch.Tensor, found_inf: torch.Tensor) -> None:
        """One AdamW step on ``factor`` x the model's gradients, unless ``found_inf`` (0-d device
        tensors) is non-zero; the bf16 weights follow the masters."""
        work = []
        for group in self.optimizer.param_groups:
            fused, other = [], []  # (model param, master, its state)
            for m in group["params"]:
                p = self.model_of.get(id(m), m)
                if p.grad is None:
                    continue
                state = self._state(m)
                tensors = (p, p.grad, m, state["exp_avg"], state["exp_avg_sq"])
                if (p is not m and p.device.type in self.kernel_devices
                        and p.dtype == p.grad.dtype == torch.bfloat16
                        and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)):
                    fused.append((p, m, state))
                else:
                    other.append((p, m, state))
            work.append((group, fused, other))
        steps = [s["step"] for _, fused, other in work for _, _, s in fused + other]
        if not steps:
            return
        keep = 1.0 - found_inf.float()
        # a skipped step does not count, as in torch's fused AdamW; a list, not one 0-d device
        # tensor: that overload reads the tensor on the host (a sync before the update, seen on a GPU)
        torch._foreach_add_(steps, [keep] * len(steps))
        for group, fused, other in work:
            if fused:
                self._launch(group, fused, factor.float(), found_inf.float())
            if other:
                self._unfused(group, other, factor, found_inf)
        self.optimizer._opt_called = True  # what optimizer.step() sets: the LR scheduler checks it

    def _state(self, m: torch.Tensor) -> dict:
        state = self.optimizer.state[m]
        if not state:  # as torch's fused AdamW makes it, so either path can resume from the other
            state["step"] = torch.zeros((), dtype=torch.float32, device=m.device)
            state["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)
        elif state["step"].device != m.device or state["step"].dtype != torch.float32:
            # a non-fused AdamW keeps its count on the host: the kernels read it on the device
            state["step"] = state["step"].to(device=m.device, dtype=torch.float32)
        return state

    def _launch(self, group: dict, fused: list, factor: torch.Tensor, found_inf: torch.Tensor) -> None:
        device = fused[0][1].device
        numels = tuple(m.numel() for _, m, _ in fused)
        if numels not in self._blocks:
            if len(self._blocks) >= 8:  # the set of tensors with gradients keeps changing: keep few tables
                self._blocks.clear()
            per = [-(-n // _BLOCK) for n in numels]
            tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), torch.tensor(per))
            start = torch.cat([torch.arange(k, dtype=torch.int64) * _BLOCK for k in per])
            self._blocks[numels] = (torch.tensor(numels, dtype=torch.int64).to(device), tensor.to(device),
                                    start.to(torch.int32 if max(numels) < 2 ** 31 else torch.int64).to(device))
        numel_t, block_tensor, block_start = self._blocks[numels]
        columns = ([p.grad for p, _, _ in fused], [m for _, m, _ in fused], [s["exp_avg"] for _, _, s in fused],
                   [s["exp_avg_sq"] for _, _, s in fused], [p for p, _, _ in fused], [s["step"] for _, _, s in fused])
        # addresses change when gradients are remade or a resume loads new state: a fresh table each
        # step, copied without blocking the host (pinned)
        ptrs = torch.tensor([t.data_ptr() for col in columns for t in col], dtype=torch.int64)
        if device.type == "cuda":
            ptrs = ptrs.pin_memory().to(device, non_blocking=True)
        if self._kernel is None:
            self._kernel = _triton_kernel()
        beta1, beta2 = group["betas"]
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            self._kernel[(block_tensor.numel(),)](
                ptrs, numel_t, block_tensor, block_start, found_inf, factor, len(fused),
                float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                float(group["weight_decay"]), BLOCK=_BLOCK)

    @staticmethod
    def _unfused(group: dict, other: list, factor: torch.Tensor, found_inf: torch.Tensor) -> None:
        """torch's fused AdamW on fp32 gradients (the masters' dtype), then the bf16 copies."""
        grads = [p.grad.float() if p is not m else p.grad for p, m, _ in other]
        beta1, beta2 = group["betas"]
        torch._fused_adamw_([m for _, m, _ in other], grads, [s["exp_avg"] for _, _, s in other],
                            [s["exp_avg_sq"] for _, _, s in other], [], [s["step"] for _, _, s in other],
                            amsgrad=False, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                            grad_scale=factor.reciprocal().float(), found_inf=found_inf.float())
        cast = [(p, m) for p, m, _ in other if p is not m]
        if cast:
            torch._foreach_copy_([p for p, _ in cast], [m for _, m in cast])

