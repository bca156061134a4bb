"""PII scrubbing (`data.curate.pii`): e-mail addresses and IP addresses replaced by
placeholders. The patterns are datatrove's PIIFormatter's kind: an address of a plausible
shape; an IP candidate is kept only when Python's `ipaddress` parses it, so version numbers
such as 3.11.4 stay, and so do IPv6-shaped words without a digit (`a::b`)."""

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
    if ":" in candidate and not any(c.isdigit() for c in candidate):
        return False  # "a::b", "be::ef": names in code and prose, not addresses
    try:
        ipaddress.ip_address(candidate)
    except ValueError:
        return False
    return True


def scrub(text: str, cfg: PiiConfig) -> tuple[str, int, int]:
    """(`text` with e-mail and IP addresses replaced, how many e-mails, how many IPs)."""
    text, emails = EMAIL.subn(cfg.email_placeholder, text)
    ips = 0

    def replace_ip(match: re.Match) -> str:
        nonlocal ips
        if not _address(match.group(0)):
            return match.group(0)
        ips += 1
        return cfg.ip_placeholder

    text = IPV4.sub(replace_ip, text)
    text = IPV6.sub(replace_ip, text)
    return text, emails, ips
