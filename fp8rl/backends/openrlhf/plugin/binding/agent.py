"""The binding in the vLLM engine actors: the sampler's top-k into the response (Score Centering).

OpenRLHF 0.11.2's engine actor (``vllm_engine.RolloutRayActor``, shipped by value) builds a
``SingleTurnAgentExecutor`` (resolved by reference from ``openrlhf.utils.agent``) whose ``execute``
asks the engine for one sample (``llm_engine.generate``) and turns vLLM's ``RequestOutput`` into the
response dict the PPO trainer actor receives; of the per-token logprob dicts it keeps only the
sampled token's log-prob (``rollout_log_probs``). For a Score Centering cell
(``PluginSpec.score_centering``) the wrapped ``execute`` hands upstream's a recording stand-in of
the engine (its ``generate`` returns the engine's own output and keeps it), then adds the top-k of
that output to the response (``plugin.score_centering.topk_from_logprobs``, key ``RESPONSE_KEY``):
upstream's response is otherwise unchanged. Requests that did not ask for ``logprobs >= k``
(evaluation) get nothing added. Without Score Centering upstream's ``execute`` is left in place.
"""

from __future__ import annotations

from fp8rl.backends.openrlhf.plugin.binding.common import _check_params, _originals
from fp8rl.backends.openrlhf.plugin.spec import PluginSpec, check_version


class _Recorder:
    """The engine as ``execute`` sees it: ``generate`` keeps the ``RequestOutput`` it returns."""

    def __init__(self, engine) -> None:
        self._engine, self.output = engine, None

    async def generate(self, *args, **kwargs):
        self.output = await self._engine.generate(*args, **kwargs)
        return self.output

    def __getattr__(self, name):
        return getattr(self._engine, name)


def add_topk(response: dict, request_output, sampling_params, k: int) -> dict:
    """``response`` with the sampler's top-k of ``request_output`` (when the request asked for
    ``logprobs >= k``)."""
    from fp8rl.backends.openrlhf.plugin.score_centering import RESPONSE_KEY, topk_from_logprobs

    asked = getattr(sampling_params, "logprobs", None)
    if asked is None or asked < k:
        return response
    if request_output is None:
        raise RuntimeError("the agent executor returned without calling the engine's generate")
    out = request_output.outputs[0]
    response[RESPONSE_KEY] = topk_from_logprobs(out.token_ids, out.logprobs, k)
    return response


def bind_agent(agent_module, spec: PluginSpec) -> None:
    check_version()
    cls = agent_module.SingleTurnAgentExecutor
    if spec.score_centering is None:  # upstream's (a rebinding starts from the originals)
        saved = _originals(cls, ())
        if "execute" in saved:
            cls.execute = saved["execute"]
        return
    orig = _originals(cls, ("execute",))["execute"]
    _check_params(orig, ("self", "prompt", "label", "sampling_params", "max_length", "hf_tokenizer", "llm_engine",
                         "images"), "SingleTurnAgentExecutor.execute")
    k = int(spec.score_centering["topk"])

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        engine = _Recorder(llm_engine)
        response = await orig(self, prompt, label, sampling_params, max_length, hf_tokenizer, engine, images)
        return add_topk(response, engine.output, sampling_params, k)

    cls.execute = execute
