"""Import stand-in for flash-attn (see ../README.md)."""
