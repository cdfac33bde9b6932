"""The PNG of a run: training loss and the metrics of the evaluations during training
(validation, or test without a validation set) against the step, with the best evaluation
(``best``, as metrics.json records it) and the test metric of the model tested marked on
every panel."""

from __future__ import annotations

from pathlib import Path


def plot_curves(history: dict, path: Path, title: str, best: dict | None = None,
                eval_set: str = "held-out", test: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    evals = history["eval"]
    names = [k for k in (evals[0] if evals else {}) if k not in ("step", "epoch")]
    fig, axes = plt.subplots(1, 1 + len(names), figsize=(4.5 * (1 + len(names)), 3.4))
    axes = list(axes) if len(names) else [axes]
    train = [t for t in history["train"] if t["loss"] is not None]  # None: every step skipped
    axes[0].plot([t["step"] for t in train], [t["loss"] for t in train], color="tab:blue")
    axes[0].set(xlabel="step", ylabel="training loss", title="training")
    for ax, name in zip(axes[1:], names):
        ax.plot([e["step"] for e in evals], [e[name] for e in evals], "o-", color="tab:orange",
                label=eval_set)
        if best and best.get(name) is not None:
            ax.axvline(best["step"], color="tab:green", linestyle="--", linewidth=1)
            ax.plot([best["step"]], [best[name]], "*", color="tab:green", markersize=12,
                    label=f"best (step {best['step']})")
        if test and test.get(name) is not None and eval_set == "validation":
            ax.plot([test["step"]], [test[name]], "X", color="tab:red", markersize=9,
                    label=f"test, {test['model']} model")
        ax.legend(fontsize=8)
        ax.set(xlabel="step", ylabel=name, title=f"{eval_set} {name}")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
