"""`raytrain-lm plan`'s table: the candidates cheapest first, the cheapest that meets the
deadline (and budget) marked, then what was measured and what assumed."""

from __future__ import annotations


def _hours(h: float) -> str:
    return f"{h:,.1f} h" if h < 72 else f"{h / 24:,.1f} d"


def _every(steps: int | None) -> str:
    return "end only" if steps is None else f"{steps:,} steps"


def render(result: dict, rows: int = 15) -> str:
    """The plan as plain text: one header, `rows` candidates (the cheapest that meets the
    deadline always among them), the recommendation and the inputs."""
    estimates, best = result["estimates"], result["cheapest"]
    shown = estimates[:rows]
    if best is not None and best not in shown:
        shown.append(best)
    head = (
        f"{result['run']}: {result['tokens'] / 1e9:,.2f}B tokens, "
        f"{result['params'] / 1e6:,.0f}M parameters, {result['flops_per_token'] / 1e9:,.2f} "
        "GFLOP per token"
    )
    if result["deadline_h"] is not None:
        head += f", deadline {_hours(result['deadline_h'])}"
    if result["budget_usd"] is not None:
        head += f", budget ${result['budget_usd']:,.0f}"
    columns = ("", "type", "capacity", "workers", "strategy", "tokens/s", "wall", "cost",
               "goodput", "interrupts", "checkpoint every")  # fmt: skip
    table = [columns]
    for e in shown:
        mark = "*" if e == best else ("" if e["meets_deadline"] and e["within_budget"] else "x")
        table.append(
            (
                mark,
                e["accelerator"],
                e["capacity"].replace("_", "-"),
                str(e["workers"]),
                e["strategy"],
                f"{e['tokens_per_s']:,.0f}",
                _hours(e["wall_h"]),
                f"${e['cost_usd']:,.0f}",
                f"{e['goodput']:.1%}",
                f"{e['interruptions']:.1f}",
                _every(e["checkpoint_every_steps"]),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    lines = [head, ""]
    for row in table:
        cells = [
            c.ljust(w) if i < 5 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    lines.append("")
    if not estimates:
        lines.append("no candidate: no worker count planned fits the model or splits the batch")
    elif best is None:
        lines.append(
            "no candidate meets the deadline and budget (x): more workers or a later deadline"
        )
    else:
        lines.append(
            f"* cheapest within the deadline: {best['workers']} x {best['accelerator']} "
            f"{best['capacity'].replace('_', '-')} ({best['strategy']}), "
            f"${best['cost_usd']:,.0f} in {_hours(best['wall_h'])}; checkpoint every "
            f"{_every(best['checkpoint_every_steps'])} (Young/Daly: "
            f"{_every(best['young_daly_steps'])})"
        )
    if len(estimates) > len(shown):
        lines.append(f"({len(estimates) - len(shown)} more candidates: --rows N or --json)")
    if result["batch_does_not_split"]:
        counts = ", ".join(str(n) for n in result["batch_does_not_split"])
        lines.append(
            f"left out {counts} workers: training.global_batch_size "
            f"({result['global_batch_size']}) does not split over them as set"
        )
    measured = "; ".join(result["inputs"]["measured"]) or "nothing (plan --from RUN measures)"
    lines.append(f"measured: {measured}")
    lines.append(f"assumed: {'; '.join(result['inputs']['assumed'])}")
    catalog = result["catalog"]
    lines.append(f"catalog: {catalog['path']}, as of {catalog['as_of']} (its sources inside)")
    return "\n".join(lines)
