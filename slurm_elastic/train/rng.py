"""Random-number-generator states of one process as JSON-able data (no pickle)."""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class RawRng:
    """The generators' states as the libraries return them: cheap enough to take every step
    (tens of microseconds); `rng_json` turns one into manifest data when it is needed."""

    torch_state: torch.Tensor
    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    cuda: tuple[torch.Tensor, ...] | None


def capture_rng_raw() -> RawRng:
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return RawRng(torch.get_rng_state(), random.getstate(), np.random.get_state(), cuda)


def rng_json(raw: RawRng) -> dict[str, Any]:
    version, internal, gauss = raw.python
    name, keys, pos, has_gauss, cached = raw.numpy
    state: dict[str, Any] = {
        "torch": base64.b64encode(raw.torch_state.numpy().tobytes()).decode("ascii"),
        "python": [version, list(internal), gauss],
        "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }
    if raw.cuda is not None:
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode("ascii") for s in raw.cuda]
    return state


def capture_rng() -> dict[str, Any]:
    return rng_json(capture_rng_raw())


def restore_rng(state: dict[str, Any]) -> None:
    raw = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        states = [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
