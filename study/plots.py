"""PNG plots for the study report and the law-fit CLI (matplotlib, Agg canvas, no display), and a command that
plots runs' metrics against step:

    covrl plots RUN_DIR [RUN_DIR ...] [--key actor/entropy --key critic/score/mean ...] [--out DIR]

one PNG per key (OUT/<key with / as _>.png), one line per run labelled by its directory name; OUT defaults to
RUN_DIR/plots for a single run and must be given for several.

Every helper takes plain data (series of (x, y) pairs keyed by label), writes one
PNG atomically (temp file, then rename) and returns its path. Figures are built
with `matplotlib.figure.Figure` on an Agg canvas rather than through pyplot, so no
GUI backend is ever touched and no figure stays registered after the call.
Labels keep the order they are given in and label i always gets colour "C<i>",
so a method has the same colour in every plot when callers pass the same order.
An empty series set still yields a valid PNG that says "no data".
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from study.lawfit import LawFit, merge_rows, row_value
from study.archive import read_run

Series = dict[str, list[tuple[float, float]]]  # label -> [(x, y), ...]


def _save(fig: Figure, path: str) -> str:
    """Write `fig` as PNG to `path` via a temp file and rename, so readers never see half an image. The image is
    stored with a 256-colour palette: line plots on white lose nothing visible and take about a third of the bytes
    (the recorded studies' plots travel with the tracked tree to every GPU command, under a size budget)."""
    from PIL import Image  # matplotlib's own dependency

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")  # a legend beside the axes stays in the image
    buf.seek(0)
    with Image.open(buf) as im:
        im.convert("RGB").quantize(colors=256).save(tmp, format="PNG", optimize=True)
    os.replace(tmp, path)
    return path


def _figure(width_in: float, height_in: float) -> Figure:
    """A figure with fixed margins (constrained layout would double the render time on a small CPU)."""
    fig = Figure(figsize=(width_in, height_in))
    fig.subplots_adjust(left=0.85 / width_in, right=1 - 0.2 / width_in, bottom=0.6 / height_in,
                        top=1 - 0.6 / height_in, wspace=0.08, hspace=0.4)
    return fig


def _no_data(ax, why: str = "no data") -> None:
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="grey")


def plot_lines(panels: dict[str, Series], path: str, *, xlabel: str, ylabel: str, title: str, sharex: bool = True) -> str:
    """One subplot per panel (shared y axis, and x unless `sharex` is False: panels of different lengths), one line
    per label; returns `path`.

    `panels` maps a panel title to its series; a single panel gives a single plot.
    """
    names = list(panels) or [""]
    cols = min(len(names), 3)
    rows = math.ceil(len(names) / cols)
    fig = _figure(6.4 * cols, 4.2 * rows)
    axes = fig.subplots(rows, cols, sharex=sharex, sharey=True, squeeze=False).ravel()
    labels = list(dict.fromkeys(label for series in panels.values() for label in series))
    for i, (ax, name) in enumerate(zip(axes, names)):
        series = panels.get(name, {})
        drawn = 0
        for label, pts in series.items():
            if pts:
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker="." if len(pts) < 30 else None, color=f"C{labels.index(label)}", label=label)
                drawn += 1
        if drawn:
            ax.legend(fontsize="small")
        else:
            _no_data(ax)
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        if i % cols == 0:  # the y axis is shared: label it once per row
            ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    for ax in axes[len(names):]:
        ax.set_visible(False)
    fig.suptitle(title)
    return _save(fig, path)


def plot_metric(rows_by_label: dict[str, list[dict]], key: str, path: str, *, title: str | None = None) -> str:
    """`key` against `step` for several runs on shared axes (rows missing the key are skipped)."""
    series = {label: [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and "step" in r]
              for label, rows in rows_by_label.items()}
    return plot_lines({"": series}, path, xlabel="step", ylabel=key, title=title or f"{key} vs step")


def _curve(fit: LawFit, lo: float, hi: float, n: int = 50) -> tuple[list[float], list[float]]:
    hs = [lo + (hi - lo) * i / (n - 1) for i in range(n)]
    return hs, [fit.predict(h) for h in hs]


def plot_law_fit(points: Series, fits: dict[str, LawFit | None], path: str, *, pooled: LawFit | None = None,
                 ylabel: str = "accuracy", title: str = "R = -a exp(H) + b",
                 within: list[tuple[float, float]] | None = None) -> str:
    """Scatter of (entropy, reward) points per label, each label's fitted curve (dashed, over its own
    entropy range) and the pooled fit (black, over all points' range); returns `path`. With `within`, a second
    panel: exp(H) against accuracy, both demeaned within each step across runs (the law's test at equal step)."""
    many = len(points) > 6  # a study with seeds and staleness runs: legend beside the plot, 20 distinct colours
    fig = _figure((11.5 if many else 7.5) + (4.5 if within is not None else 0), 5)
    axes = fig.subplots(1, 2, width_ratios=[2.2, 1]) if within is not None else [fig.subplots()]
    ax = axes[0]
    all_h = [h for pts in points.values() for h, _ in pts]
    for i, (label, pts) in enumerate(points.items()):
        if not pts:
            continue
        color = matplotlib.colormaps["tab20"](i % 20) if many else f"C{i}"
        hs, rs = zip(*pts)
        ax.scatter(hs, rs, s=18, color=color, label=label)
        fit = fits.get(label)
        if fit is not None and max(hs) > min(hs):
            ax.plot(*_curve(fit, min(hs), max(hs)), "--", color=color,
                    label=f"{label} fit: a={fit.a:.3g} b={fit.b:.3g} R²={fit.r2:.2f}")
    if pooled is not None and all_h and max(all_h) > min(all_h):
        ax.plot(*_curve(pooled, min(all_h), max(all_h)), "-", color="black", linewidth=2,
                label=f"pooled fit: a={pooled.a:.3g} b={pooled.b:.3g} R²={pooled.r2:.2f}")
    if all_h and many:  # beside the figure, right of any second panel
        handles, labels = ax.get_legend_handles_labels()
        fig.legend(handles, labels, fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 0.94))
    elif all_h:
        ax.legend(fontsize="small")
    else:
        _no_data(ax)
    ax.set_xlabel("policy entropy H")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize="medium")
    ax.grid(alpha=0.3)
    if within is not None:
        _within_panel(axes[1], within)
    return _save(fig, path)


def _within_panel(ax, within: list[tuple[float, float]]) -> None:
    """exp(H) against accuracy after removing each step's mean across runs: the law predicts a falling cloud."""
    if within:
        xs, ys = zip(*within)
        ax.scatter(xs, ys, s=12, color="C0", alpha=0.7)
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.axvline(0, color="grey", linewidth=0.8)
    else:
        _no_data(ax, "no step evaluated in 3 runs")
    ax.set_xlabel("exp(H) − its step's mean")
    ax.set_ylabel("accuracy − its step's mean")
    ax.set_title("GRPO family at equal step", fontsize="medium")
    ax.grid(alpha=0.3)


def plot_scatter(points: Series, path: str, *, xlabel: str, ylabel: str, title: str) -> str:
    """Scatter of (x, y) points per label with the x = 0 and y = 0 lines drawn; returns `path`."""
    fig = _figure(7, 5)
    ax = fig.subplots()
    drawn = 0
    for i, (label, pts) in enumerate(points.items()):
        if pts:
            xs, ys = zip(*pts)
            ax.scatter(xs, ys, s=14, alpha=0.7, color=f"C{i}", label=label)
            drawn += 1
    if drawn:
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.axvline(0, color="grey", linewidth=0.8)
        ax.legend(fontsize="small")
    else:
        _no_data(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _save(fig, path)


DEFAULT_KEYS = ("actor/entropy", "critic/score/mean", "response_length/mean")
RUN_PLOTS = {"reward.png": "critic/score/mean", "entropy.png": "actor/entropy", "response_length.png": "response_length/mean"}


def run_plots(run_dir: str) -> list[str]:
    """The pictures of one run, in RUN_DIR/plots (written at the end of every run): reward, entropy and response
    length against step, held-out accuracy per data source against step, and held-out accuracy against the
    evaluated version's entropy with the law R = -a exp(H) + b where it has enough points. Returns their paths."""
    from study.lawfit import MIN_FIT_POINTS, eval_points, eval_sources, fit_law, key_series

    rows = merge_rows(read_run(run_dir))
    out = os.path.join(run_dir, "plots")
    name = os.path.basename(os.path.abspath(run_dir))
    paths = [plot_metric({name: rows}, key, os.path.join(out, png), title=f"{name}: {key}")
             for png, key in RUN_PLOTS.items()]
    sources = eval_sources(rows)
    if sources:
        acc = {ds: key_series(rows, f"eval/{ds}/acc") for ds in sources}
        paths.append(plot_lines({"": acc}, os.path.join(out, "eval_acc.png"), xlabel="step",
                                ylabel="held-out accuracy (eval/<ds>/acc)", title=f"{name}: held-out accuracy"))
        pts = [(h, r) for _, h, r in eval_points(rows)]
        fit = None
        if len(pts) >= MIN_FIT_POINTS and len({h for h, _ in pts}) > 1:
            fit = fit_law([h for h, _ in pts], [r for _, r in pts])
        title = f"{name}: {fit.formula(3)}, R² {fit.r2:.2f}" if fit else f"{name}: too few points to fit the law"
        paths.append(plot_law_fit({"evaluated versions": pts}, {"evaluated versions": fit},
                                  os.path.join(out, "acc_vs_entropy.png"), ylabel="mean held-out accuracy", title=title))
    return paths


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 every PNG written, 2 bad arguments or a run without any of the keys."""
    ap = argparse.ArgumentParser(prog="covrl plots", description="Plot metrics of one or more runs against step.")
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    ap.add_argument("--key", action="append", dest="keys", metavar="KEY",
                    help=f"metrics.jsonl key, repeatable (default: {', '.join(DEFAULT_KEYS)})")
    ap.add_argument("--out", help="directory for the PNGs (default RUN_DIR/plots; required with several runs)")
    args = ap.parse_args(argv)
    keys = args.keys or list(DEFAULT_KEYS)
    if args.out is None and len(args.run_dirs) > 1:
        ap.error("--out is required with several runs: their plots are shared, so no one run directory owns them")
    labels = [os.path.basename(os.path.abspath(d)) for d in args.run_dirs]
    if len(set(labels)) != len(labels):
        ap.error(f"runs need distinct directory names (they label the lines), got {', '.join(labels)}")
    rows = {}
    for label, run_dir in zip(labels, args.run_dirs):
        rows[label] = merge_rows(read_run(run_dir))
        if not rows[label]:
            print(f"error: {run_dir}/metrics.jsonl is missing or has no rows with a step; pass a covrl run "
                  f"directory", file=sys.stderr)
            return 2
        if not any(row_value(r, k) is not None for r in rows[label] for k in keys):
            print(f"error: {run_dir}/metrics.jsonl has none of {', '.join(keys)}; pick keys it logs with --key",
                  file=sys.stderr)
            return 2
    out = args.out or os.path.join(args.run_dirs[0], "plots")
    for key in keys:
        print(plot_metric(rows, key, os.path.join(out, key.replace("/", "_") + ".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
