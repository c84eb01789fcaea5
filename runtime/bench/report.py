"""`specstore report`: Markdown tables and PNG plots from one or more bench result files."""

from __future__ import annotations

import json
import math
from pathlib import Path

from specstore.runtime.bench.host import DISTURBED_CORES, other_cores
from specstore.runtime.errors import SpecstoreError
from specstore.schemas.bench import BenchResult


def load_result(path: str | Path) -> BenchResult:
    path = Path(path)
    try:
        return BenchResult.model_validate_json(path.read_text())
    except OSError as exc:
        raise SpecstoreError(f"cannot read bench result {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise SpecstoreError(f"{path} is not a specstore bench result: {str(exc).splitlines()[0]}") from None


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _speedup(m) -> str:
    """``1.23x [1.10, 1.35]``: the speedup and its bootstrap interval (absent in older files)."""
    text = f"{_fmt(m.speedup_vs_ar)}x"
    if m.speedup_vs_ar is not None and m.speedup_ci is not None:
        text += f" [{m.speedup_ci[0]:.2f}, {m.speedup_ci[1]:.2f}]"
    return text


def markdown_table(result: BenchResult, title: str) -> str:
    lines = [
        f"### {title}",
        "",
        f"model `{result.model}`, datastore `{result.datastore}`, {result.device} {result.dtype}, "
        f"{result.max_new_tokens} new tokens, temperature {result.temperature}, torch {result.torch_version}, "
        f"transformers {result.transformers_version}",
        "",
        "| method | MAT | acceptance | tokens/s | speedup vs ar (bootstrap interval over prompts) | drafting share | retrieval ms (median) | identical to ar |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in result.methods.items():
        ident = "-" if m.identical_to_ar is None else f"{'yes' if m.identical_to_ar else 'no'} ({m.identical_share:.0%})"
        if not m.lossless:  # e.g. respec with relaxed verification: the output may differ from ar
            name = f"{name} (LOSSY, {m.num_relaxed} relaxed)"
        lines.append(
            f"| {name} | {m.mat:.2f} | {m.acceptance_rate:.1%} | {m.tokens_per_s:.1f} | {_speedup(m)} "
            f"| {m.drafting_share:.1%} | {_fmt(m.retrieval_ms_median, '.3f')} | {ident} |"
        )
    lines += host_lines(result)
    categories = sorted({c for m in result.methods.values() for c in m.per_category})
    if len(categories) > 1:
        lines += ["", "MAT per category:", "", "| method | " + " | ".join(categories) + " |", "|---" * (len(categories) + 1) + "|"]
        for name, m in result.methods.items():
            cells = [_fmt(m.per_category[c].mat) if c in m.per_category else "-" for c in categories]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def host_lines(result: BenchResult) -> list[str]:
    """What else the host did during the runs (bench/host.py): the runs where other work
    averaged at least ``DISTURBED_CORES`` cores, whose times are not the method's alone; a line
    saying the host was quiet otherwise; nothing where it was not measured (older files, not Linux)."""
    cpus = result.machine.get("cpu_count")
    cpus = int(cpus) if isinstance(cpus, int | float) else None
    loads = [(r, other_cores(r.host_other_s, r.host_steal_s or 0.0, r.wall_s, cpus)) for r in result.prompts
             if r.host_other_s is not None]
    if not loads:
        return []
    disturbed = sorted(((r, c) for r, c in loads if c >= DISTURBED_CORES), key=lambda rc: -rc[1])
    if not disturbed:  # the largest shown rounded down: 0.249 is below the bound, not "0.25"
        return ["", f"Host: quiet; other work averaged at most {math.floor(100 * max(c for _, c in loads)) / 100:.2f} cores in any of the "
                f"{len(loads)} runs (processes besides the bench, and the hypervisor's steal)."]
    shown = ", ".join(f"{r.prompt_id}{'' if r.turn == 1 else f'/{r.turn}'} {r.method} ({c:.2f})" for r, c in disturbed[:8])
    more = f" and {len(disturbed) - 8} more" if len(disturbed) > 8 else ""
    return ["", f"**Host busy**: other work (processes besides the bench, the hypervisor's steal) averaged "
            f"{DISTURBED_CORES} cores or more during {len(disturbed)} of {len(loads)} runs, so their times are not "
            f"the method's alone: prompt method (cores) {shown}{more}. Rerun on a quiet machine to compare speeds."]


def plot(result: BenchResult, out_dir: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(result.methods)
    paths = []

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].bar(names, [result.methods[n].mat for n in names], color="tab:blue")
    ax[0].set_title("MAT (tokens per target forward)")
    ax[1].bar(names, [result.methods[n].speedup_vs_ar or 0 for n in names], color="tab:green")
    ax[1].axhline(1.0, color="grey", lw=0.8)
    ax[1].set_title("speedup over ar (same run)")
    for a in ax:
        a.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    paths.append(out_dir / f"{stem}_mat_speedup.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    drafting = [n for n in names if result.methods[n].accepted_length_histogram]
    for i, n in enumerate(drafting):
        hist = result.methods[n].accepted_length_histogram
        total = sum(hist.values())
        xs = sorted(hist)
        ax.bar([x + i * 0.8 / max(len(drafting), 1) for x in xs], [hist[x] / total for x in xs],
               width=0.8 / max(len(drafting), 1), label=n)
    ax.set_xlabel("accepted draft tokens per step")
    ax.set_ylabel("share of steps")
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / f"{stem}_accepted_hist.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    categories = sorted({c for m in result.methods.values() for c in m.per_category})
    if len(categories) > 1:
        fig, ax = plt.subplots(figsize=(max(6, len(categories) * 1.2), 3.5))
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            per = result.methods[n].per_category
            ax.bar([j + i * width for j in range(len(categories))], [per[c].mat if c in per else 0 for c in categories],
                   width=width, label=n)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories, rotation=30)
        ax.set_title("MAT per category")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out_dir / f"{stem}_mat_per_category.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _size_sweep(path: str | Path) -> dict | None:
    """A MAT-against-size file (benchmarks/mat_vs_size.py), None for anything else."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("kind") == "mat_vs_size" else None


def size_table(data: dict, title: str) -> str:
    lines = [f"### {title}", "",
             f"{data['num_prompts']} held-out prompts ({data['questions']}), {data['max_new_tokens']} new tokens, "
             "replayed greedy references; 95% bootstrap interval over prompts", "",
             "| datastore | index | tokens | method | MAT | 95% interval |", "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['datastore']} | {r['index']} | {r['tokens']:,} | {r['method']} | {r['mat']:.3f} | "
                     f"{r['mat_low']:.3f}-{r['mat_high']:.3f} |")
    return "\n".join(lines) + "\n"


def size_plot(data: dict, out_dir: Path, stem: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for (method, index), rows in sorted(_group(data["rows"]).items()):
        rows = sorted(rows, key=lambda r: r["tokens"])
        x = [r["tokens"] for r in rows]
        y = [r["mat"] for r in rows]
        err = [[r["mat"] - r["mat_low"] for r in rows], [r["mat_high"] - r["mat"] for r in rows]]
        ax.errorbar(x, y, yerr=err, marker="o" if index == "sparse" else "s", capsize=3, label=f"{method} ({index})")
    ax.set_xscale("log")
    ax.set_xlabel("datastore tokens")
    ax.set_ylabel("MAT (tokens per target forward)")
    ax.set_title("MAT against datastore size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / f"{stem}_mat_vs_size.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _group(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["index"]), []).append(r)
    return groups


def report(paths: list[str], out_dir: str | Path | None = None) -> str:
    """Markdown for every result (and PNG plots into ``out_dir`` when given); a MAT-against-size
    file of benchmarks/mat_vs_size.py gets its table and plot."""
    parts = []
    for p in paths:
        sweep = _size_sweep(p)
        if sweep is not None:
            parts.append(size_table(sweep, Path(p).stem))
            if out_dir is not None:
                png = size_plot(sweep, Path(out_dir), Path(p).stem)
                parts.append(f"![{png.stem}]({png.name})\n")
            continue
        result = load_result(p)
        stem = Path(p).stem
        parts.append(markdown_table(result, stem))
        if out_dir is not None:
            for png in plot(result, Path(out_dir), stem):
                parts.append(f"![{png.stem}]({png.name})\n")
    return "\n".join(parts)
