"""Whether a layer whose blocks poolrunner runs inline must run transformers' own forward instead.

:mod:`~poolrunner.core.model.bert_layers` and :mod:`~poolrunner.core.model.decoder_layers` call
some of a layer's blocks' code directly rather than as modules; a forward hook on such a block
(transformers' attention capture hooks the attention modules) or a global module hook would then
never fire, so those calls go through transformers' forward.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def hooked(blocks: Iterable[nn.Module]) -> bool:
    """Whether a forward hook waits on one of ``blocks`` or on every module."""
    return (any(block._forward_hooks or block._forward_pre_hooks for block in blocks)
            or bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks))
