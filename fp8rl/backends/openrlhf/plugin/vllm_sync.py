"""New trainer weights into an FP8 vLLM 0.29 engine: a streamed layer-wise reload.

Why not ``model.load_weights``: after loading, vLLM's FP8 linear methods run
``process_weights_after_loading``, which quantizes the weights and puts them back as plain
``nn.Parameter``s (``replace_parameter``); the ``weight_loader`` attributes of vLLM's parameter
classes (``ModelWeightParameter``, ``PerTensorScaleParameter``, ...) are gone, and a second
``model.load_weights`` with BF16 tensors fails inside the loaders (an ``AssertionError`` on
vLLM 0.29, reproduced on CPU in ``tests/integration``). OpenRLHF's ``WorkerWrap.update_weight``
does exactly that, once per parameter.

What vLLM 0.29 supports for new weights (``GPUModelRunner.reload_weights``,
``vllm/v1/worker/gpu_model_runner.py``, with ``is_checkpoint_format=True``)::

    initialize_layerwise_reload(model)      # kernel tensors kept; layers back to their
                                            # load-time (meta) parameters and loaders
    model.load_weights(weights_iterator)    # buffered per layer; a layer whose weights are
                                            # all in is materialised, loaded with the original
                                            # loaders, re-quantized (process_weights_after_loading)
                                            # and copied into the kernel tensors' storage
    finalize_layerwise_reload(model, model_config)   # layers not (fully) loaded

all inside ``set_current_vllm_config`` (``gpu_worker.Worker.reload_weights``). OpenRLHF sends
one parameter per RPC, so :class:`LayerwiseSync` streams that same sequence across the calls of
one weight sync: the first parameter opens the reload, every parameter goes through
``model.load_weights``, and the last one -- OpenRLHF marks it with ``empty_cache=True`` (``count
== num_params`` in ``ActorPPOTrainer.broadcast_to_vllm``) -- finalizes it. Memory: only the
weights of the layers being completed are buffered (OpenRLHF sends them in module order),
instead of a BF16 copy of the whole model that a single ``reload_weights`` call would need.
The kernel tensors keep their storage (CUDA graphs stay valid).

This is the one module that touches vLLM internals; it is pinned to vLLM 0.29.0
(``spec.check_vllm_version``), and ``tests/integration`` runs it against vLLM 0.29's real
Qwen3 model and online FP8 methods on CPU (per-tensor and per-channel) and checks the sequence
above against vLLM's source.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class LayerwiseSync:
    """One weight sync at a time into ``get_model()``, streamed through vLLM's layer-wise reload.

    Args:
        get_model: returns the vLLM model (``worker.model_runner.get_model``).
        vllm_config: the engine's ``VllmConfig`` (``worker.vllm_config``); its ``model_config``
            is what ``finalize_layerwise_reload`` needs.
    """

    def __init__(self, get_model: Callable[[], torch.nn.Module], vllm_config) -> None:
        self._get_model = get_model
        self._vllm_config = vllm_config
        self._model: torch.nn.Module | None = None
        self.loaded = 0

    @property
    def open(self) -> bool:
        """True between the first and the last parameter of a sync."""
        return self._model is not None

    def load(self, name: str, weight: torch.Tensor, *, last: bool) -> None:
        """Load one checkpoint-format (BF16, unsharded) tensor; ``last`` ends the sync."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        with set_current_vllm_config(self._vllm_config):
            if self._model is None:
                self._model = self._get_model()
                self.loaded = 0
                initialize_layerwise_reload(self._model)
            self._model.load_weights(weights=[(name, weight)])
            self.loaded += 1
            if last:
                model, self._model = self._model, None
                finalize_layerwise_reload(model, self._vllm_config.model_config)
