"""What ``sncaffe plan`` shows: a table of the modes and their memory timelines as a PNG."""
from __future__ import annotations

from ..sizes import fmt_bytes
def plan_line(plan, auto=False, name="", process_rss=None) -> str:
    """The one line said before the first iteration: what was decided and what it costs.
    ``process_rss``: what the process holds outside the pools now (the runtime measures it),
    for the resident memory expected on one RAM."""
    def of(peak, room):
        return fmt_bytes(peak) + (f" of {fmt_bytes(room)}" if room is not None else "")
    parts = [f"memory plan{' of ' + name if name else ''}: mode '{plan.mode}'"
             + (" (auto)" if auto else "") + (" with parameters on the host" if plan.host_params and not plan.param_disk else "")
             + (" with parameters on disk" if plan.param_disk else ""),
             f"device peak {of(plan.peak, plan.capacity)}",
             f"host peak {of(plan.host_peak, plan.host_capacity)}"]
    if plan.disk_peak:
        parts.append(f"disk peak {of(plan.disk_peak, plan.disk_capacity)}")
    if plan.ram is not None:
        parts.append(f"together {of(plan.peak + plan.host_peak, plan.ram)} RAM")
    moved = plan.d2h_bytes + plan.h2d_bytes
    parts.append(f"{fmt_bytes(moved)} moved per iteration ({fmt_bytes(plan.d2h_bytes)} out, "
                 f"{fmt_bytes(plan.h2d_bytes)} back)")
    parts.append(f"{plan.recompute_flops / 1e9:.1f} GFLOP recomputed"
                 + (f" (whole segments, convolutions included: {plan.segments}"
                    + (f"; {plan.kept} layer chains kept, not replayed: {fmt_bytes(plan.kept_bytes)}"
                       if plan.kept else "") + ")"
                    if plan.granularity else ""))
    if plan.ram is not None and (plan.resident or process_rss is not None):
        if not plan.resident:               # one RAM: what the process will hold at its peak
            plan.resident = expected_rss(plan, process_rss)     # (said before anything is allocated)
        parts.append(f"resident memory expected {fmt_bytes(plan.resident)}")
    return ", ".join(parts)


def verdict(plan, name="", auto=True, device="") -> str:
    """One line: whether it fits, the mode, what each tier needs, and the traffic per iteration:
    ``LeNet fits on cpu: mode 'none' (auto) needs device 9 MiB of 15 GiB, host 0 B of 15 GiB,
    together 9 MiB of 15 GiB RAM; 0 B moved per iteration``."""
    def of(peak, room):
        return fmt_bytes(peak) + (f" of {fmt_bytes(room)}" if room is not None else "")
    tiers = [f"device {of(plan.peak, plan.capacity)}", f"host {of(plan.host_peak, plan.host_capacity)}"]
    if plan.disk_peak:
        tiers.append(f"disk {of(plan.disk_peak, plan.disk_capacity)}")
    if plan.ram is not None:
        tiers.append(f"together {of(plan.peak + plan.host_peak, plan.ram)} RAM")
    hosted = f" with parameters on {'disk' if plan.param_disk else 'the host'}" if plan.host_params else ""
    # kept chains spend room the plan was given: what it needs is less by their bytes
    kept = (f" (it keeps {fmt_bytes(plan.kept_bytes)} of layer chains to replay less, and fits in less)"
            if plan.kept else "")
    return (f"{name or 'the net'} {'fits' if plan.fits else 'does NOT fit'}{' on ' + device if device else ''}: "
            f"mode '{plan.mode}'{' (auto)' if auto else ''}{hosted} needs {', '.join(tiers)}{kept}; "
            f"{fmt_bytes(plan.d2h_bytes + plan.h2d_bytes)} moved per iteration")


def expected_rss(plan, process_rss) -> int:
    """The process's peak resident memory on the CPU device: both pools at their peaks (their
    arenas are only resident where touched) beside what the process holds outside them now."""
    return plan.peak + plan.host_peak + process_rss


def plan_table(plans, capacity=None) -> str:
    """One line per mode: peak, fit, peak over the lower bound, traffic and recomputation."""
    head = (f"{'mode':<10}{'peak':>12}{'fits':>6}{'peak/bound':>12}{'to host':>12}{'from host':>12}"
            f"{'host peak':>12}{'recompute':>12}{'cache hit/miss':>16}")
    lines = [head, "-" * len(head)]
    notes = []
    for p in plans:
        ok = p.fits if p.capacity is not None else p.peak <= (capacity or 0)
        fits = "-" if capacity is None else ("yes" if ok else "NO")
        lines.append(f"{p.mode:<10}{fmt_bytes(p.peak):>12}{fits:>6}{p.peak / max(p.lower_bound, 1):>12.2f}"
                     f"{fmt_bytes(p.d2h_bytes):>12}{fmt_bytes(p.h2d_bytes):>12}{fmt_bytes(p.host_peak):>12}"
                     f"{p.recompute_flops / 1e9:>9.1f} GF{p.cache_hits:>9}/{p.cache_misses:<6}"
                     + (" *" if p.note else ""))
        if p.note and p.note not in notes:
            notes.append(p.note)
    return "\n".join(lines + [f"* {n}" for n in notes])


def _op_axis(t) -> list:
    """The operator index (runs so far, replays included) at every point of a timeline: one
    x axis for every mode, whatever instructions each adds."""
    xs, k, runs = [], 0, [at for at, _ in t.steps]
    for i in range(len(t.device)):
        while k < len(runs) and runs[k] <= i:
            k += 1
        xs.append(k)
    return xs


def draw_timelines(plans, path, title="", capacity=None, more=()) -> None:
    """Memory in use over one iteration, against the operator index: the device (log scale,
    so modes a hundred times apart are all readable) above, the host and disk tiers below.
    ``plans``: one per mode; ``more``: (label, plans) drawn alike (the plans at the given
    capacity, with parameters on the host). Every location of a placed net is its own curve,
    and each curve's peak is marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, low) = plt.subplots(2, 1, figsize=(15, 8.5), dpi=110, sharex=True,
                                   gridspec_kw={"height_ratios": [3, 2]})
    styles = ["-", "--", "-.", ":"]
    groups = [("", plans)] + list(more)
    n, seen = 0, {}
    for g, (label, group) in enumerate(groups):
        for p in group:
            for loc, t in sorted(p.timelines.items() or [("", p.timeline)]):
                xs = _op_axis(t)
                name = f"{p.mode}{' ' + label if label else ''}{' @ ' + loc if loc else ''}"
                key = (tuple(t.device), tuple(t.host))
                if key in seen:             # drawn thinner on top of its twin, and said so
                    name += f" (= {seen[key]})"
                seen.setdefault(key, name)
                style = dict(linestyle=styles[g % len(styles)], linewidth=max(0.7, 3.2 - 0.35 * n), alpha=0.85)
                line, = top.plot(xs, [max(b, 1) / 2**30 for b in t.device], label=f"{name} (peak {fmt_bytes(t.peak)})",
                                 **style)
                i = max(range(len(t.device)), key=t.device.__getitem__)
                top.plot([xs[i]], [t.device[i] / 2**30], marker="v", color=line.get_color(), markersize=7)
                if t.host_peak:
                    low.plot(xs, [b / 2**30 for b in t.host], color=line.get_color(), label=f"{name}: host",
                             **style)
                if t.disk_peak:
                    low.plot(xs, [b / 2**30 for b in t.disk], color=line.get_color(), label=f"{name}: disk",
                             linestyle=":", linewidth=2.2)
                n += 1
    if plans:
        lb = plans[0].lower_bound
        top.axhline(lb / 2**30, color="grey", linestyle=":", label=f"lower bound {fmt_bytes(lb)}")
        top.set_ylim(bottom=lb / 2**30 / 64)      # a location's empty start would stretch the log axis
        fwd = sum(1 for ins in plans[-1].schedule.forward if ins.kind == "run")
        for ax in (top, low):
            ax.axvline(fwd, color="grey", linewidth=0.6)
        top.text(fwd, top.get_ylim()[1], " backward", va="top", fontsize=8, color="grey")
    if capacity is not None:
        top.axhline(capacity / 2**30, color="red", linestyle="--", label=f"device {fmt_bytes(capacity)}")
    top.set_yscale("log")
    top.set_ylabel("device memory in use (GiB, log)")
    low.set_ylabel("host and disk (GiB)")
    low.set_xlabel("operator index (forward, then backward; replays counted)")
    top.set_title(title or "sncaffe memory plan")
    top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if low.get_legend_handles_labels()[0]:
        low.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for ax in (top, low):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
