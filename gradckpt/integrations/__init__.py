"""Layer 7: integrations with other libraries (Hugging Face transformers, diffusers, ...).

Importing this package (``import gradckpt`` does) registers each library's
:class:`~gradckpt.profiling.adapters.Adapter`: how to prepare its models for
profiling, their fake-tensor-friendly paths, their blocks and their training
switches. The profiler and the API consult that registry; they never import an
integration. Nothing heavy is imported here: ``gradckpt.integrations.hf`` never
imports transformers at import time; it recognizes its classes by module name.

Example:
    >>> from gradckpt.integrations import hf
    >>> hf.enable(model, policy=gradckpt.policies.save_matmuls)
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from torch import nn

from gradckpt.integrations import diffusers_unet, hf
from gradckpt.profiling.adapters import Adapter, register_adapter

__all__ = ["DIFFUSERS", "TRANSFORMERS"]


def _fake_friendly(model: nn.Module) -> AbstractContextManager[None]:
    return hf.fake_friendly()


TRANSFORMERS = register_adapter(
    Adapter(
        "transformers",
        recognizes=hf.is_hf_model,
        prepare=hf.planning,
        fake_inputs=_fake_friendly,
        training=hf.training,
    )
)
# diffusers U-Nets: the generic rules pick the wrong grain (see diffusers_unet).
DIFFUSERS = register_adapter(
    Adapter(
        "diffusers",
        recognizes=diffusers_unet.is_diffusers_model,
        find_blocks=diffusers_unet.unet_blocks,
    )
)
