# To add to tests/hooks/test_context_parallel.py (diffusers). CPU, one process.
import logging

import torch
from diffusers.hooks import context_parallel
from diffusers.hooks.context_parallel import ContextParallelSplitHook
from diffusers.models._modeling_parallel import ContextParallelInput


def test_input_of_other_dims_warns_once_and_is_not_split(monkeypatch, caplog):
    # Without transformers imported, `logging.Logger` has no `warning_once`.
    monkeypatch.delattr(logging.Logger, "warning_once", raising=False)
    hook = ContextParallelSplitHook({}, None)
    x = torch.zeros(2)
    cp_input = ContextParallelInput(split_dim=1, expected_dims=2)
    logger = logging.getLogger(context_parallel.__name__)
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.WARNING, logger=context_parallel.__name__):
        assert hook._prepare_cp_input(x, cp_input) is x
        assert hook._prepare_cp_input(x, cp_input) is x
    warned = [r for r in caplog.records if "split will not be applied" in r.getMessage()]
    assert len(warned) <= 1
