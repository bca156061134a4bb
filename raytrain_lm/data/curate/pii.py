"""PII scrubbing (`data.curate.pii`): e-mail addresses and IP addresses replaced by
placeholders. The patterns are datatrove's PIIFormatter's kind: an address of a plausible
shape. An IP candidate is kept only when Python's `ipaddress` parses it, so 3.11.4 and
256.1.1.1 stay; an IPv6 one needs three groups and a digit, so code's `a[1::2]`, `a::b` and
`std::vector` stay. Known false positives: four-part version numbers (2.0.0.1) are valid IPv4
addresses, and code's `x@obj.attr` (matrix products) looks like an e-mail unless the object is
`self`, `cls` or `this`."""

from __future__ import annotations

import ipaddress
import re

from raytrain_lm.config.curate import PiiConfig

EMAIL = re.compile(
    r"(?<![\w.+-])[A-Za-z0-9._%+-]+@(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+[A-Za-z]{2,}\b"
)
IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.]*\d)")
IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")


def _address(candidate: str) -> bool:
    if ":" in candidate:
        groups = [g for g in candidate.split(":") if g]
        if len(groups) < 3 or not any(c.isdigit() for c in candidate):
            return False  # "1::2" (a slice), "a::b": code and prose, not addresses
    try:
        ipaddress.ip_address(candidate)
    except ValueError:
        return False
    return True


_CODE_OBJECTS = ("self.", "cls.", "this.")


def scrub(text: str, cfg: PiiConfig) -> tuple[str, int, int]:
    """(`text` with e-mail and IP addresses replaced, how many e-mails, how many IPs)."""
    emails = ips = 0

    def replace_email(match: re.Match) -> str:
        nonlocal emails
        if match.group(0).split("@", 1)[1].startswith(_CODE_OBJECTS):
            return match.group(0)
        emails += 1
        return cfg.email_placeholder

    text = EMAIL.sub(replace_email, text)

    def replace_ip(match: re.Match) -> str:
        nonlocal ips
        if not _address(match.group(0)):
            return match.group(0)
        ips += 1
        return cfg.ip_placeholder

    text = IPV4.sub(replace_ip, text)
    text = IPV6.sub(replace_ip, text)
    return text, emails, ips
