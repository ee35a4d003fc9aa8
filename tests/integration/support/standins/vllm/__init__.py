"""Import stand-in for vLLM on OpenRLHF's actor path (see ../README.md); using it raises."""

__version__ = "0.29.0"


class _StandIn:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("vLLM import stand-in of the integration tier: vLLM needs a GPU")


SamplingParams = AsyncEngineArgs = AsyncLLMEngine = _StandIn
