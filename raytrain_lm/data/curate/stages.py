"""The curation stages applied to one document in the reading tasks (prepare_tasks.read_group),
in order: PII scrubbing, then the quality rules; and the tally of what they did, per source,
which the manifest keeps and `prepare` prints.

Each document is judged alone, so the result does not depend on how inputs are grouped into
tasks or on how many nodes run them. A tally is a plain dict of counts (JSON as it stands):

    {source index: {"in": [documents, bytes],
                    "pii": [documents changed, e-mails, IPs],
                    "removed": {rule: [documents, bytes]},
                    "kept": [documents, bytes]}}

Bytes are UTF-8 bytes: "in" before scrubbing, "removed" and "kept" after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raytrain_lm.config.curate import CurateConfig
from raytrain_lm.data.curate.pii import scrub
from raytrain_lm.data.curate.quality import RULES, first_failed_rule

KEPT = -1  # the rule code of a kept document
# Every rule that removes documents, by code: the quality rules, then the duplicate stages'.
ALL_RULES = (*RULES, "exact_duplicate", "near_duplicate")
EXACT_DUPLICATE, NEAR_DUPLICATE = len(RULES), len(RULES) + 1


@dataclass(frozen=True)
class Judged:
    text: str  # scrubbed when PII scrubbing is on
    rule: int  # index into RULES of the rule that removed it, or KEPT
    bytes: int  # UTF-8 bytes of the (scrubbed) text, removed or not
    emails: int = 0
    ips: int = 0

    @property
    def pii(self) -> tuple[int, int]:
        return self.emails, self.ips


def is_code(uri: str, cfg: CurateConfig) -> bool:
    name = uri.rsplit("/", 1)[-1].lower()
    return any(name.endswith(ext) for ext in cfg.quality.code_extensions)


def judge(text: str, uri: str, cfg: CurateConfig) -> Judged:
    """What the stages make of one document of the input `uri`."""
    emails = ips = 0
    if cfg.pii.enabled:
        text, emails, ips = scrub(text, cfg.pii)
    size = len(text.encode("utf-8"))
    if cfg.quality.enabled and not is_code(uri, cfg):
        failed = first_failed_rule(text, cfg.quality)
        if failed is not None:
            return Judged(text, RULES.index(failed), size, emails, ips)
    return Judged(text, KEPT, size, emails, ips)


# Columns of a per-document record (the reading task's rows, the index beside a piece).
RECORD = ("source", "in_bytes", "bytes", "rule", "emails", "ips")


def tally(records: np.ndarray) -> dict[str, dict]:
    """The tally (module docstring) of per-document records, an int array of RECORD columns
    (`bytes`: after scrubbing)."""
    out: dict[str, dict] = {}
    columns = dict(zip(RECORD, records.T, strict=True)) if len(records) else {}
    for source in sorted({int(s) for s in columns.get("source", [])}):
        mine = columns["source"] == source
        rule, size = columns["rule"][mine], columns["bytes"][mine]
        emails, ips = columns["emails"][mine], columns["ips"][mine]
        kept = rule == KEPT
        out[str(source)] = {
            "in": [int(mine.sum()), int(columns["in_bytes"][mine].sum())],
            "pii": [int(((emails + ips) > 0).sum()), int(emails.sum()), int(ips.sum())],
            "removed": {
                name: [int((rule == code).sum()), int(size[rule == code].sum())]
                for code, name in enumerate(ALL_RULES)
                if (rule == code).any()
            },
            "kept": [int(kept.sum()), int(size[kept].sum())],
        }
    return out


def merge(total: dict[str, dict], part: dict[str, dict]) -> dict[str, dict]:
    """`total` with the counts of `part` added (both tallies)."""
    for source, counts in part.items():
        into = total.setdefault(
            source, {"in": [0, 0], "pii": [0, 0, 0], "removed": {}, "kept": [0, 0]}
        )
        for key in ("in", "pii", "kept"):
            into[key] = [a + b for a, b in zip(into[key], counts[key], strict=True)]
        for rule, pair in counts["removed"].items():
            have = into["removed"].get(rule, [0, 0])
            into["removed"][rule] = [have[0] + pair[0], have[1] + pair[1]]
    return total
