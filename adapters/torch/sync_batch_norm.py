"""Batch normalization with statistics over the whole global batch (every rank's shard)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

import hvddp
from hvddp import ProcessSet, Sum, global_process_set
from hvddp._grouping import check_process_set
from hvddp.ops import announce_refusal

from .mpi_ops import allreduce

__all__ = ["SyncBatchNorm"]

class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm{1,2,3}d`` whose training statistics span every rank's batch.

    In training mode the per-channel mean and variance are those of the concatenation of all
    ranks' inputs (ranks may hold different batch sizes), so N ranks on B/N samples each give
    the output, gradients and running statistics of ``BatchNorm`` on B samples in one process.
    Two allreduces per forward (sum, then the sum of squared deviations) and two per backward,
    named after its channel count; every rank must run the layer the same number of times, or
    have called ``join()`` (such a rank adds nothing: the others normalize their batches). In eval
    mode, or with a size-1 ``process_set``, it is plain batch norm on this rank's input, as torch's
    ``SyncBatchNorm`` (without running statistics: this rank's batch statistics), so a rank may
    evaluate alone. A step whose global batch is empty leaves the running statistics alone, and
    one with a single value per channel raises ``ValueError`` on every rank, as ``BatchNorm`` does;
    so does a training step whose input needs a gradient on some ranks only (their backward would
    wait for the others' in the statistics' allreduces). An input that is not floating-point
    raises ``TypeError`` on every rank.

    Args:
        num_features, eps, momentum, affine, track_running_stats: as ``torch.nn.BatchNorm2d``.
        process_set: the ranks whose batches are normalized together.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set, device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device,
                         dtype=dtype)
        self.process_set = check_process_set(process_set, "SyncBatchNorm")

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions (N, C, ...), "
                             f"got {input.dim()}D.")
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got an input with {input.shape[1]} "
                             f"channels (shape {tuple(input.shape)}); its dimension 1 must be "
                             f"num_features={self.num_features}.")
        if not input.is_floating_point():  # (torch's BatchNorm raises NotImplementedError)
            raise TypeError(f"SyncBatchNorm({self.num_features}) got an input of dtype {input.dtype} "
                            f"(shape {tuple(input.shape)}); it normalizes floating-point inputs: cast "
                            f"it first, e.g. input.float() (images as uint8: input.float() / 255).")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        ps = self.process_set
        syncs = self.training and ps.size() > 1 and ps.included()
        try:
            self._check_input_dim(input)
        except (ValueError, TypeError) as exc:
            if syncs:  # the peers wait for this layer's first allreduce: fail it there too
                announce_refusal(hvddp.allreduce, exc, name=f"sync_batch_norm.{self.num_features}.sum",
                                 op=Sum, process_set=ps)
            raise
        factor = 0.0 if self.momentum is None else self.momentum
        # counted once the batch went through: a call that failed on the peers (a refused input
        # on one rank) must not count on some ranks only (momentum=None averages over the count)
        counts = self.training and self.track_running_stats and self.num_batches_tracked is not None
        if counts and self.momentum is None:
            factor = 1.0 / (float(self.num_batches_tracked) + 1.0)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        if not syncs:  # (eval: no communication)
            out = F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                               bn_training, factor, self.eps)
        else:
            out = self._sync_forward(input, running_mean, running_var, factor)
        if counts:
            self.num_batches_tracked.add_(1)
        return out

    def _sync_forward(self, x, running_mean, running_var, factor):
        if x.dtype in (torch.float16, torch.bfloat16):  # statistics (and counts) in float32
            return self._sync_forward(x.float(), running_mean, running_var, factor).to(x.dtype)
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, channels] + [1] * (x.dim() - 2)
        # with the count, whether this rank's backward will run the statistics' allreduces (an
        # autograd node is recorded only where the input needs a gradient) and a 1 for taking part:
        # a rank that called join() adds zeros to both, and its peers' backward meets it too
        needs = torch.is_grad_enabled() and x.requires_grad
        count = torch.tensor([x.numel() // channels, float(needs), 1.0], dtype=x.dtype, device=x.device)
        # Named by the channel count, not by the layer: a rank that built one more layer (a copy
        # for evaluation, say) would otherwise shift every later layer's name and never meet its
        # peers. Each call blocks, so layers of the same width can share a name (Horovod's names
        # are fixed), and the response cache still holds one entry per width. (Ranks whose layer
        # widths differ wait on different names: the stall inspector names both.)
        name = f"sync_batch_norm.{channels}"
        totals = allreduce(torch.cat([x.sum(dims), count]), op=Sum, name=f"{name}.sum",
                           process_set=self.process_set)
        n = totals[channels].detach()
        total = float(n)  # the same on every rank: all take the same branch
        needing, members = int(totals[channels + 1]), int(totals[channels + 2])
        if 0 < needing < members:  # the ranks that need it would wait in backward for the others
            raise ValueError(
                f"SyncBatchNorm({self.num_features}): its input needs a gradient on {needing} of "
                f"{members} ranks (on this rank: {'yes' if needs else 'no'}); backward's allreduces "
                f"would wait for ever on those ranks. Run the layer alike on every rank: an input "
                f"that requires grad (or not) everywhere, torch.no_grad() on all ranks or none.")
        if total == 0:  # nothing anywhere: an empty output, the running statistics left alone
            # (through weight and bias, so both get zero gradients, as BatchNorm's)
            return x * self.weight.view(shape) + self.bias.view(shape) if self.weight is not None else x.clone()
        if total == 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel when training, "
                             f"got 1 over all ranks (input size {tuple(x.shape)} on this rank), as "
                             f"torch's BatchNorm would.")
        mean = totals[:channels] / n
        centered = x - mean.view(shape)
        var = allreduce((centered * centered).sum(dims), op=Sum, name=f"{name}.sqsum",
                        process_set=self.process_set) / n
        y = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                unbiased = var.detach() * (total / max(total - 1, 1.0))
                running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        return y

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_set: ProcessSet = global_process_set) -> torch.nn.Module:
        """Return ``module`` with every ``BatchNorm*d`` replaced by a ``SyncBatchNorm`` (same state)."""
        return cls._convert(module, process_set, "")

    @classmethod
    def _convert(cls, module: torch.nn.Module, process_set: ProcessSet, path: str) -> torch.nn.Module:
        out = module
        if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
            # (it became SyncBatchNorm(0), whose first forward blamed the input's channel count)
            raise ValueError(
                f"SyncBatchNorm.convert_sync_batchnorm: {path or 'the module'} is a "
                f"{type(module).__name__} whose num_features is not known yet; run the model once on "
                f"a batch (or build {type(module).__name__.replace('Lazy', '')}(num_features)) before "
                f"converting it.")
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_set)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
        for name, child in module.named_children():
            out.add_module(name, cls._convert(child, process_set, f"{path}.{name}" if path else name))
        return out
