"""Import stand-in (see ../README.md)."""

TokensPrompt = dict
