"""The head-property predictor: per (layer, head, position) features -> (bgt0, k, p_streaming).

A feed-forward network with a shared backbone and three heads (Fluxion section 5): `bgt0` and `k`
are the intercept and slope of the head's budget law `bgt(blk) = bgt0 + k * log2(blk)` (Eq. 1),
`p_streaming` the probability that the GPU-resident tokens alone meet the error bound `tau`.

The network carries its own standardisation: feature mean/std and the regression targets'
mean/std are buffers, so one state dict (one checkpoint file) holds everything `predict` needs
and a caller hands in raw features. This package depends on torch (and numpy) only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

CHECKPOINT_FORMAT = 1
DEFAULT_HIDDEN = (256, 256, 128)


class HeadPropertyNet(nn.Module):
    """Shared MLP backbone (Linear + SiLU per hidden layer) and three linear heads.

    `forward` works in standardised units (the training loss lives there); `predict` takes raw
    features and returns `bgt0`, `k` in budget units and `p_streaming` in [0, 1].
    """

    def __init__(self, n_features: int, hidden: Sequence[int] = DEFAULT_HIDDEN):
        super().__init__()
        hidden = tuple(int(h) for h in hidden)
        if n_features < 1:
            raise ValueError(f"n_features must be >= 1, got {n_features}")
        if not hidden or min(hidden) < 1:
            raise ValueError(f"hidden must be one or more positive layer widths, got {hidden}")
        self.n_features = int(n_features)
        self.hidden = hidden
        layers: list[nn.Module] = []
        width = self.n_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.SiLU()]
            width = h
        self.backbone = nn.Sequential(*layers)
        self.bgt0_head = nn.Linear(width, 1)
        self.k_head = nn.Linear(width, 1)
        self.streaming_head = nn.Linear(width, 1)
        # Standardisation, set from the training split by `set_standardisation`; identity until then.
        self.register_buffer("feature_mean", torch.zeros(self.n_features))
        self.register_buffer("feature_std", torch.ones(self.n_features))
        self.register_buffer("target_mean", torch.zeros(2))  # bgt0, k
        self.register_buffer("target_std", torch.ones(2))

    @torch.no_grad()
    def set_standardisation(self, features: torch.Tensor, bgt0: torch.Tensor, k: torch.Tensor) -> None:
        """Feature and target mean/std from training rows. A constant feature (std 0) gets std 1,
        so it standardises to 0 instead of dividing by zero."""
        f = features.double()
        std = f.std(dim=0, unbiased=False)
        self.feature_mean.copy_(f.mean(dim=0))
        self.feature_std.copy_(torch.where(std > 1e-12, std, torch.ones_like(std)))
        t = torch.stack([bgt0.double(), k.double()], dim=1)
        tstd = t.std(dim=0, unbiased=False) if t.shape[0] else torch.ones(2, dtype=torch.float64)
        self.target_mean.copy_(t.mean(dim=0) if t.shape[0] else torch.zeros(2, dtype=torch.float64))
        self.target_std.copy_(torch.where(tstd > 1e-12, tstd, torch.ones_like(tstd)))

    def standardise(self, features: torch.Tensor) -> torch.Tensor:
        return (features - self.feature_mean) / self.feature_std

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Standardised features `[N, F]` -> standardised `bgt0`, `k` and the streaming logit, each `[N]`."""
        h = self.backbone(z)
        return self.bgt0_head(h)[:, 0], self.k_head(h)[:, 0], self.streaming_head(h)[:, 0]

    @torch.no_grad()
    def predict(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raw features `[N, F]` (on the network's device) -> `(bgt0, k, p_streaming)`, each `[N]`.

        Only shape, dtype and device are checked (host metadata): no value is read back, so this
        issues no host-device synchronisation and can be captured in a CUDA graph.
        """
        if features.dim() != 2 or features.shape[1] != self.n_features:
            raise ValueError(f"features must be [N, {self.n_features}], got {list(features.shape)}")
        if not features.is_floating_point():
            raise ValueError(f"features must be a floating-point tensor, got {features.dtype}")
        dev = self.feature_mean.device
        if features.device != dev:
            raise ValueError(f"features are on {features.device}, the predictor on {dev}: move one of them")
        z = self.standardise(features.to(self.feature_mean.dtype))
        bgt0_z, k_z, logit = self(z)
        bgt0 = bgt0_z * self.target_std[0] + self.target_mean[0]
        k = k_z * self.target_std[1] + self.target_mean[1]
        return bgt0, k, torch.sigmoid(logit)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


@dataclass
class Checkpoint:
    """A trained predictor and what it was trained for.

    `feature_names` fixes the order of the feature columns; `tau` is the error bound its labels
    were made with; `data` describes the training data; `metrics` holds held-out metrics.
    """

    model: HeadPropertyNet
    feature_names: list[str]
    tau: float
    data: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)

    def check_feature_names(self, names: Sequence[str]) -> None:
        """Raise unless `names` are the checkpoint's feature columns in the same order."""
        names = [str(n) for n in names]
        if names != self.feature_names:
            missing = [n for n in self.feature_names if n not in names]
            extra = [n for n in names if n not in self.feature_names]
            raise ValueError(
                f"features do not match the checkpoint's {len(self.feature_names)} columns"
                + (f"; missing {missing}" if missing else "") + (f"; not in the checkpoint {extra}" if extra else "")
                + ("; same names in another order" if not missing and not extra else "")
            )

    def save(self, path: str | Path) -> None:
        """One file: the state dict (weights + standardisation buffers) and plain metadata."""
        m = self.model
        if len(self.feature_names) != m.n_features:
            raise ValueError(f"{len(self.feature_names)} feature names for a network of {m.n_features} features")
        payload = {
            "format": CHECKPOINT_FORMAT,
            "state_dict": {k: v.detach().cpu() for k, v in m.state_dict().items()},
            "n_features": m.n_features,
            "hidden": list(m.hidden),
            "feature_names": list(self.feature_names),
            "tau": float(self.tau),
            "data": self.data,
            "metrics": self.metrics,
            "training": self.training,
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(payload, path)


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Checkpoint:
    """Read a checkpoint written by `Checkpoint.save` (weights only: no pickled code runs)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no predictor checkpoint at {path}")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        fmt = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{path} is not a predictor checkpoint of format {CHECKPOINT_FORMAT} (got {fmt!r})")
    model = HeadPropertyNet(int(payload["n_features"]), payload["hidden"])
    model.load_state_dict(payload["state_dict"])
    model.eval().to(device)
    tau = float(payload["tau"])
    if not math.isfinite(tau):
        raise ValueError(f"{path}: tau must be finite, got {tau}")
    return Checkpoint(model, [str(n) for n in payload["feature_names"]], tau, payload.get("data", {}),
                      payload.get("metrics", {}), payload.get("training", {}))


__all__ = ["Checkpoint", "DEFAULT_HIDDEN", "HeadPropertyNet", "load_checkpoint"]
