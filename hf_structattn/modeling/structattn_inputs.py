"""Input checks of the MLR ops (``structattn_mlr.mlr_attention``, the reference): q/k/v shapes and dtypes,
positions, biases. Each raises a one-line ``ValueError`` naming the argument. Part of the checkpoint payload."""

from typing import Optional

import torch


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, same_length: bool = True) -> None:
    """Raise ``ValueError`` unless q, k (B, H, Tq|Tk, E) and v (B, H, Tk, dv) share one floating dtype and
    consistent shapes, with at least one query and one key."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, H, T, E); got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must share one floating dtype (float16, bfloat16, float32 or float64); got "
                         f"q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.shape[:2] != q.shape[:2] or k.shape[-1] != q.shape[-1] or v.shape[:3] != k.shape[:3] or (
            same_length and k.shape[2] != q.shape[2]):
        raise ValueError(f"expected q, k of shape (B, H, T, r) and v of shape (B, H, T, dv); got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError(f"attention needs at least one query and one key position; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)} (sequence length 0)")



def check_positions(positions: Optional[torch.Tensor], batch: int, length: int, device=None,
                    name: str = "positions") -> Optional[torch.Tensor]:
    """(B, T) int64 positions from a (B, T), (1, T) or (T,) integer tensor, or None."""
    if positions is None:
        return None
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.is_complex() \
            or positions.dtype == torch.bool:
        kind = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"{name} must be an integer tensor of shape ({batch}, {length}), got {kind}")
    if positions.dim() == 1:
        positions = positions[None]
    if positions.dim() != 2 or positions.shape[0] not in (1, batch) or positions.shape[1] != length:
        raise ValueError(f"{name} must have shape ({batch}, {length}) (or ({length},)), got {tuple(positions.shape)}")
    return positions.to(device=device, dtype=torch.long).expand(batch, length)


def check_bias(bias: Optional[torch.Tensor], shape: tuple, name: str = "bias") -> None:
    """Raise ``ValueError`` unless ``bias`` is a floating tensor broadcastable to ``shape`` (B, H, Tq, Tk)."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or not bias.dtype.is_floating_point:
        kind = bias.dtype if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"{name} must be a floating tensor broadcastable to {tuple(shape)}, got {kind}")
    if bias.dim() > 4:
        raise ValueError(f"{name} must be broadcastable to {tuple(shape)} (B, H, Tq, Tk), got {tuple(bias.shape)}")
    try:
        broadcast = torch.broadcast_shapes(tuple(bias.shape), tuple(shape))
    except RuntimeError:
        broadcast = None
    if broadcast != tuple(shape):
        raise ValueError(f"{name} must be broadcastable to {tuple(shape)} (B, H, Tq, Tk), got {tuple(bias.shape)}")



__all__ = ["check_bias", "check_positions", "check_qkv"]
