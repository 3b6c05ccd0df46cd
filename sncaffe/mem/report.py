"""What ``sncaffe plan`` shows: a table of the modes and their memory timelines as a PNG."""
from __future__ import annotations

from .pool import fmt_bytes


def plan_line(plan, auto=False, name="") -> str:
    """The one line said before the first iteration: what was decided and what it costs."""
    def of(peak, room):
        return fmt_bytes(peak) + (f" of {fmt_bytes(room)}" if room is not None else "")
    parts = [f"memory plan{' of ' + name if name else ''}: mode '{plan.mode}'"
             + (" (auto)" if auto else "") + (" with parameters on the host" if plan.host_params else ""),
             f"device peak {of(plan.peak, plan.capacity)}",
             f"host peak {of(plan.host_peak, plan.host_capacity)}"]
    if plan.disk_peak:
        parts.append(f"disk peak {of(plan.disk_peak, plan.disk_capacity)}")
    if plan.ram is not None:
        parts.append(f"together {of(plan.peak + plan.host_peak, plan.ram)} RAM")
    moved = plan.d2h_bytes + plan.h2d_bytes
    parts.append(f"{fmt_bytes(moved)} moved per iteration ({fmt_bytes(plan.d2h_bytes)} out, "
                 f"{fmt_bytes(plan.h2d_bytes)} back)")
    parts.append(f"{plan.recompute_flops / 1e9:.1f} GFLOP recomputed")
    return ", ".join(parts)


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


def draw_timelines(plans, path, title="", capacity=None) -> None:
    """Device bytes in use over the steps of one iteration, one line per mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=110)
    for p in plans:
        t = p.timeline
        n = max(len(t.device) - 1, 1)
        ax.plot([i / n for i in range(len(t.device))], [b / 2**30 for b in t.device],
                label=f"{p.mode} (peak {fmt_bytes(p.peak)})", linewidth=1.2)
    if plans:
        lb = plans[0].lower_bound
        ax.axhline(lb / 2**30, color="grey", linestyle=":", label=f"lower bound {fmt_bytes(lb)}")
        t = plans[-1].timeline
        fwd = t.backward_start / max(len(t.device) - 1, 1)
        ax.axvline(fwd, color="grey", linewidth=0.6)
        ax.text(fwd, ax.get_ylim()[1] * 0.98, " backward", va="top", fontsize=8, color="grey")
    if capacity is not None:
        ax.axhline(capacity / 2**30, color="red", linestyle="--", label=f"device {fmt_bytes(capacity)}")
    ax.set_xlabel("progress through one iteration (forward, then backward)")
    ax.set_ylabel("device memory in use (GiB)")
    ax.set_title(title or "sncaffe memory plan")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
