"""Import stand-in (see ../README.md): OpenRLHF uses these for packed samples only (off on CPU)."""


def _standin(*args, **kwargs):
    raise RuntimeError("flash-attn import stand-in of the CPU job (fp8rl cpu_support): packed samples need flash-attn")


index_first_axis = pad_input = rearrange = unpad_input = _standin
