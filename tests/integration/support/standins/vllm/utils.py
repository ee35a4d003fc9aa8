"""Import stand-in (see ../README.md)."""


def random_uuid() -> str:
    raise RuntimeError("vLLM import stand-in of the integration tier: vLLM needs a GPU")
