"""Thin entry points: launch, status, audit. Nothing imports this package."""
