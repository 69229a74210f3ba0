"""Pictures of a `ScaleMonitor` history (matplotlib)."""

import os

import numpy as np

from keras_scalify.callbacks import ScaleMonitor
from keras_scalify.callbacks import load_history


def _rows(history, stat):
    """`(labels, matrix)`: every `<layer>/<item>/<stat>` column as a row
    labelled `<layer>/<item>`, in column order."""
    labels, rows = [], []
    for key, values in history.items():
        if key.count("/") < 2:
            continue
        prefix, s = key.rsplit("/", 1)
        if s == stat:
            labels.append(prefix)
            rows.append(np.asarray(values, np.float64))
    return labels, (np.stack(rows) if rows else np.zeros((0, 0)))


def _resolve(history, trace):
    if isinstance(history, ScaleMonitor):
        return history.history, history.trace if trace is None else trace
    if isinstance(history, (str, os.PathLike)):
        h, t = load_history(history)
        return h, t if trace is None else trace
    if not isinstance(history, dict) or "step" not in history:
        raise ValueError(
            "`history` must be a ScaleMonitor, its `history` dict (with a "
            "'step' entry) or the `log_dir` it wrote, got "
            f"{type(history).__name__}."
        )
    return history, trace


def _heatmap(fig, ax, steps, labels, matrix, title, cmap, vmin=None, vmax=None):
    ax.set_title(title, fontsize=9)
    if not labels:
        ax.text(0.5, 0.5, "nothing recorded", ha="center", va="center")
        ax.set_axis_off()
        return
    masked = np.ma.masked_invalid(matrix)
    im = ax.imshow(
        masked, aspect="auto", interpolation="nearest", cmap=cmap,
        vmin=vmin, vmax=vmax,
    )
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=max(3, min(7, 400 // max(len(labels), 1))))
    n = len(steps)
    ticks = np.unique(np.linspace(0, n - 1, min(n, 8)).round().astype(int))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(int(steps[i])) for i in ticks], fontsize=7)
    ax.set_xlabel("step", fontsize=8)
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01)


def scales(history, trace=None, figsize=None, title=None):
    """Draws a `ScaleMonitor` history; returns the matplotlib `Figure`
    (save it with `fig.savefig("scales.png")`).

    Panels, one row per layer item (`<layer path>/<item>`: a weight, an
    `input`, an `output`, a `grad`) and one column per record:

    1. scale exponents (log2 of each tensor's scale; weights' gradient
       scales as `<weight>.grad_scale`): a row stuck at one value while
       its neighbours move, or at the floor, stands out;
    2. underflow fractions (values that round to zero in their format);
    3. saturation fractions (values beyond the format's max);
    4. the loss over steps (each step's value from `trace` when given, else
       the records'), with skipped steps (the optimizer's count went up)
       marked in red.

    Args:
        history: a `ScaleMonitor`, its `history` dict, or the `log_dir` it
            wrote (read with `keras_scalify.callbacks.load_history`).
        trace: the per-step `trace` dict (default: the monitor's, or the
            one in `log_dir`).
        figsize: the figure size in inches (default: from the row count).
        title: the figure's title.
    """
    from matplotlib.figure import Figure

    history, trace = _resolve(history, trace)
    steps = np.asarray(history["step"], np.float64)
    exp_labels, exps = _rows(history, "scale_exp")
    gs_labels, gss = _rows(history, "grad_scale_exp")
    exp_labels = exp_labels + [f"{l}.grad_scale" for l in gs_labels]
    exps = np.concatenate([exps, gss]) if gs_labels and exps.size else (gss if gs_labels else exps)
    under_labels, under = _rows(history, "underflow")
    sat_labels, sat = _rows(history, "saturation")
    n = max(len(exp_labels), len(under_labels), 1)
    if figsize is None:
        figsize = (11, min(40, 3 + 0.12 * (2 * n + len(under_labels))))
    fig = Figure(figsize=figsize, layout="constrained")
    heights = [max(len(exp_labels), 3), max(len(under_labels), 3), max(len(sat_labels), 3), 6]
    axes = fig.subplots(4, 1, gridspec_kw={"height_ratios": heights})
    lim = np.nanmax(np.abs(exps)) if exps.size and np.isfinite(exps).any() else 1.0
    _heatmap(fig, axes[0], steps, exp_labels, exps, "scale exponent (log2 scale)",
             "coolwarm", -lim, lim)
    _heatmap(fig, axes[1], steps, under_labels, under,
             "underflow fraction (rounds to 0 in its format)", "viridis", 0.0,
             max(float(np.nanmax(under)) if under.size and np.isfinite(under).any() else 0.0, 1e-6))
    _heatmap(fig, axes[2], steps, sat_labels, sat,
             "saturation fraction (beyond its format's max)", "magma", 0.0,
             max(float(np.nanmax(sat)) if sat.size and np.isfinite(sat).any() else 0.0, 1e-6))
    ax = axes[3]
    src = trace if trace is not None and len(trace.get("step", [])) else history
    s = np.asarray(src["step"], np.float64)
    loss = np.asarray(src.get("loss", np.full(len(s), np.nan)), np.float64)
    ax.plot(s, loss, lw=1, color="C0", label="loss")
    skipped = np.asarray(src.get("skipped_steps", np.zeros(len(s))), np.float64)
    if len(skipped):
        inc = np.diff(np.concatenate([[0.0], np.maximum(skipped, 0.0)])) > 0
        if inc.any():
            for x in s[inc]:
                ax.axvline(x, color="red", lw=0.8, alpha=0.6)
            ax.plot([], [], color="red", lw=0.8,
                    label=f"skipped step ({int(np.nanmax(skipped))} in all)")
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("loss", fontsize=8)
    if np.isfinite(loss).any() and np.nanmin(loss) > 0 and np.nanmax(loss) / np.nanmin(loss) > 20:
        ax.set_yscale("log")
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title("loss (fit's running mean), skipped steps in red", fontsize=9)
    if title:
        fig.suptitle(title)
    return fig
