"""Keep the figures an analysis module saves, for the tests that inspect them (a helper module with
a unique name, imported by the figure tests)."""

import matplotlib.pyplot as plt

import analysis.curves as curves


def capture_saved_figures(monkeypatch, module) -> list:
    """The figures ``module`` saves from now on (its ``save_figure`` wrapped; ``plt.close`` a no-op so
    they stay inspectable), in order; each is still written as the module would write it."""
    kept = []

    def save(fig, *a, **k):
        kept.append(fig)
        return curves.save_figure(fig, *a, **k)

    monkeypatch.setattr(module, "save_figure", save)
    monkeypatch.setattr(plt, "close", lambda fig=None: None)
    return kept
