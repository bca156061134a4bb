"""What curation did, as `prepare` prints it from the manifest: per source, documents and bytes
in, documents whose PII was replaced, documents and bytes removed by each rule, and what is kept."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raytrain_lm.config import DataConfig


def manifest_curation(cfg: DataConfig, counts: dict[str, dict]) -> dict | None:
    """What the manifest keeps of curation: its settings, and the tally (curate.stages) of
    each source, by name; None when curation is off."""
    if not cfg.curate.enabled:
        return None
    by_index = sorted(counts.items(), key=lambda item: int(item[0]))
    return {
        "settings": cfg.curate.model_dump(mode="json"),
        "sources": {cfg.sources[int(n)]: tally for n, tally in by_index},
    }


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def curation_table(curation: dict) -> str:
    """A plain-text table of the manifest's `curation` (one line per source and total, then
    one per removal rule)."""
    header = ("source", "documents in", "PII replaced", "removed", "kept", "kept bytes")
    rows, rules = [], {}
    totals = [0, 0, 0, 0, 0]
    for source, counts in curation["sources"].items():
        removed = sum(docs for docs, _ in counts["removed"].values())
        pii = counts["pii"]
        line = [counts["in"][0], pii[0], removed, counts["kept"][0], counts["kept"][1]]
        totals = [a + b for a, b in zip(totals, line, strict=True)]
        rows.append((source, *(f"{v:,}" for v in line[:4]), _size(line[4])))
        for rule, (docs, size) in counts["removed"].items():
            have = rules.get(rule, (0, 0))
            rules[rule] = (have[0] + docs, have[1] + size)
    if len(rows) > 1:
        rows.append(("total", *(f"{v:,}" for v in totals[:4]), _size(totals[4])))
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    lines = ["[raytrain-lm] curation (data.curate):"]
    for r in (header, *rows):
        cells = [
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  " + "  ".join(cells))
    for rule, (docs, size) in sorted(rules.items(), key=lambda x: -x[1][0]):
        lines.append(f"  removed by {rule}: {docs:,} documents, {_size(size)}")
    return "\n".join(lines)
