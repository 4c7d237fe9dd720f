"""Reading a weight file that is not the backbone's: a Dense layer, a token-weight head, a plugin's
own head. transformers reads the backbone; plugins read their extra files with :func:`load_weights`.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import TYPE_CHECKING

from poolrunner.core.errors import ModelLoadError
from poolrunner.core.model.families import one_line

if TYPE_CHECKING:
    import torch


def load_weights(path: Path | str) -> dict[str, torch.Tensor]:
    """The tensors of ``path``, on the CPU as saved: a ``.safetensors`` file, or a pickled state
    dict (``pytorch_model.bin``, ``*.pt``) read with ``torch.load(weights_only=True)``, which runs
    no code from the file.

    :raises ModelLoadError: naming the file, for a file that cannot be read, a pickle torch refuses
        to read safely (with the fix: convert it to safetensors), or content that is not a dict
        of tensors.
    """
    import torch

    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ModelLoadError(f"{path}: torch refuses to read this pickled weight file safely ({_reason(exc)}); "
                             "poolrunner never runs code from a weight file: convert it to safetensors") from None
    except Exception as exc:  # OSError, safetensors' and torch's format errors (RuntimeError, EOFError...)
        raise ModelLoadError(f"{path}: cannot read the weight file: {one_line(exc)}") from None
    if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
        raise ModelLoadError(f"{path}: expected a state dict (names to tensors), found {type(state).__name__}")
    return state


def _reason(exc: pickle.UnpicklingError) -> str:
    """What torch's safe unpickler refused (``unsupported GLOBAL ...``), without its advice to load
    unsafely and its links."""
    text = one_line(exc)
    text = text.rpartition("trusted source.")[2].partition(" Check the documentation")[0]
    return text.rpartition("WeightsUnpickler error:")[2].strip() or one_line(exc)
